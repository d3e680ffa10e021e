#!/usr/bin/env bash
# One-time (idempotent) set-up of a Debian 12 machine for forgeflow: system packages, then the
# Python package with its pinned dependencies. Re-running is fast: apt is skipped when everything
# is installed, and llama.cpp is compiled once per machine for both llama-cpp-python and llama-server
# (one build, kept in forgeflow's cache; 5-8 min cold on 2 cores). The compile runs in the background
# while torch, the Harbor venv and forgeflow's other dependencies are installed (none needs it).
# Prints how long each step took, and the total, when it ends (also when a step fails).
# PYTHON names the interpreter to install into (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(podman skopeo docker-registry debootstrap bubblewrap runc uidmap fuse-overlayfs slirp4netns postgresql
              git patch cmake build-essential ca-certificates chromium)
PY=${PYTHON:-python3}

STEP_NAMES=()
STEP_SECONDS=()
SETUP_START=$(date +%s.%N)
since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
# step NAME COMMAND...: run COMMAND, record and print its wall-clock time.
step() {
  local name=$1 start
  shift
  start=$(date +%s.%N)
  "$@"
  STEP_NAMES+=("$name")
  STEP_SECONDS+=("$(since "$start")")
  echo "setup: step '$name' took ${STEP_SECONDS[-1]} s"
}
timings() {  # timings EXIT_STATUS
  local rc=$1 i
  echo "setup: timings (s)$([ "$rc" -eq 0 ] || echo " until a step failed with exit $rc"):"
  for i in "${!STEP_NAMES[@]}"; do
    printf 'setup:   %-28s %8s\n' "${STEP_NAMES[$i]}" "${STEP_SECONDS[$i]}"
  done
  printf 'setup:   %-28s %8s\n' "total" "$(since "$SETUP_START")"
}
BACKGROUND_PID=""
# background NAME COMMAND...: start COMMAND in its own process group; finish_background records its time.
background() {
  BACKGROUND_NAME=$1
  shift
  BACKGROUND_TIME=$(mktemp)
  setsid -w bash -c 'start=$(date +%s.%N); "${@:2}"; rc=$?; awk -v a="$start" -v b="$(date +%s.%N)" \
    "BEGIN { printf \"%.1f\", b - a }" > "$1"; exit $rc' _ "$BACKGROUND_TIME" "$@" &
  BACKGROUND_PID=$!
}
finish_background() {
  local start rc=0
  start=$(date +%s.%N)
  wait "$BACKGROUND_PID" || rc=$?
  BACKGROUND_PID=""
  STEP_NAMES+=("$BACKGROUND_NAME" "  (waited for it)")
  STEP_SECONDS+=("$(cat "$BACKGROUND_TIME")" "$(since "$start")")
  rm -f "$BACKGROUND_TIME"
  echo "setup: step '$BACKGROUND_NAME' took ${STEP_SECONDS[-2]} s (in the background; waited ${STEP_SECONDS[-1]} s)"
  return $rc
}
on_exit() {
  local rc=$?
  # a failed step leaves no compile running behind (its whole process group is stopped)
  [ -z "$BACKGROUND_PID" ] || kill -- -"$BACKGROUND_PID" 2>/dev/null || true
  timings "$rc"
}
trap on_exit EXIT

apt_packages() {
  local missing=() pkg SUDO=""
  for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  if [ ${#missing[@]} -eq 0 ]; then
    echo "setup: Debian packages already installed"
    return
  fi
  echo "setup: installing Debian packages: ${missing[*]}"
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
}
step "debian packages" apt_packages

export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
echo "setup: installing forgeflow and its pinned Python dependencies (llama.cpp compiles once per machine)"
# llama.cpp compiled once per machine with forgeflow's options (a portable instruction set: a native build
# crashes on CPUs whose AMX the hypervisor does not enable) and llama.cpp's server on: the one build gives
# the llama-cpp-python wheel and llama-server with its libraries, both cached under the options. Compiled
# in the background (pip builds it in an isolated environment: it does not touch $PY's site-packages).
background "llama.cpp compile" "$PY" scripts/llama_cpp_python.py --build-only
# torch==2.13.0 is pinned first so pip takes the CPU build (an unpinned torch pulls CUDA wheels).
step "torch (cpu)" "$PY" -m pip install -q --root-user-action=ignore 'torch==2.13.0'
# Harbor (interop target, Python >= 3.12) lives in its own cached virtualenv, not in forgeflow's.
harbor_venv() { bash scripts/harbor_venv.sh >/dev/null; }
step "harbor venv" harbor_venv
# forgeflow's pinned dependencies but llama-cpp-python (its wheel is still compiling; pip would compile
# it a second time): the full install below then only adds llama-cpp-python and its [server] extras.
forgeflow_dependencies() {
  "$PY" - <<'PYTHON' > "$FORGEFLOW_REQUIREMENTS"
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for requirement in project["dependencies"] + project["optional-dependencies"]["test"]:
    if re.sub(r"[-_.]+", "_", re.split(r"[\[<>=!~; ]", requirement)[0].lower()) != "llama_cpp_python":
        print(requirement)
PYTHON
  "$PY" -m pip install -q --root-user-action=ignore -r "$FORGEFLOW_REQUIREMENTS"
}
FORGEFLOW_REQUIREMENTS=$(mktemp)
step "forgeflow dependencies" forgeflow_dependencies
rm -f "$FORGEFLOW_REQUIREMENTS"
finish_background
# installs the wheel the compile left (before forgeflow, whose llama_cpp_python pin it then satisfies)
step "llama-cpp-python" "$PY" scripts/llama_cpp_python.py
step "forgeflow [test]" "$PY" -m pip install -q --root-user-action=ignore -e '.[test]'
# llama.cpp's own llama-server (a serving backend): taken from the build above (cached under
# ~/.cache/forgeflow/llama-server-<version>-<tag>/); built here only if that step did not make it.
step "llama-server" "$PY" -c \
  'from forgeflow.serving.llama_server import ensure_llama_server; print("setup: llama-server", ensure_llama_server())'
echo "setup: done ($("$PY" -c 'import forgeflow; print("forgeflow", forgeflow.__version__)'))"
