#!/usr/bin/env bash
# One-time (idempotent) set-up of a Debian 12 machine for forgeflow: system packages, then the
# Python package with its pinned dependencies. Re-running is fast: apt is skipped when everything
# is installed, and the llama-cpp-python wheel is kept in forgeflow's cache (about 10 min cold on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(podman skopeo docker-registry debootstrap bubblewrap runc uidmap fuse-overlayfs slirp4netns postgresql
              git patch cmake build-essential ca-certificates chromium)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
# torch==2.13.0 is pinned first so pip takes the CPU build (an unpinned torch pulls CUDA wheels).
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
echo "setup: installing forgeflow and its pinned Python dependencies (llama-cpp-python compiles once per machine)"
"$PY" -m pip install -q --root-user-action=ignore 'torch==2.13.0'
# llama-cpp-python compiled once per machine with forgeflow's llama.cpp options (a portable instruction set:
# a native build crashes on CPUs whose AMX the hypervisor does not enable), its wheel cached under them.
"$PY" scripts/llama_cpp_python.py
"$PY" -m pip install -q --root-user-action=ignore -e '.[test]'
# Harbor (interop target, Python >= 3.12) lives in its own cached virtualenv, not in forgeflow's.
bash scripts/harbor_venv.sh >/dev/null
# llama.cpp's own llama-server (a serving backend), built once per machine from the pinned sdist
# (about 500 CPU-seconds; cached under ~/.cache/forgeflow/llama-server-<version>/).
"$PY" -c 'from forgeflow.serving.llama_server import ensure_llama_server; print("setup: llama-server", ensure_llama_server())'
echo "setup: done ($("$PY" -c 'import forgeflow; print("forgeflow", forgeflow.__version__)'))"
