#!/usr/bin/env bash
# One-time (idempotent) set-up of a Debian 12 machine for forgeflow: system packages, then the
# Python package with its pinned dependencies. Re-running is fast: apt is skipped when everything
# is installed, and pip's wheel cache keeps the llama-cpp-python build (20-30 min cold on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(podman skopeo docker-registry debootstrap bubblewrap runc uidmap fuse-overlayfs slirp4netns
              git patch cmake build-essential ca-certificates)
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
if ! "$PY" -c "import forgeflow, llama_cpp, prefect, trl" >/dev/null 2>&1 || [ "${FORGEFLOW_REINSTALL:-0}" = 1 ]; then
  echo "setup: installing forgeflow and its Python dependencies (llama-cpp-python compiles once per machine)"
  "$PY" -m pip install -q 'torch==2.13.0'
  "$PY" -m pip install -q -e '.[test]'
else
  "$PY" -m pip install -q --no-deps -e . >/dev/null
fi
echo "setup: done ($("$PY" -c 'import forgeflow; print("forgeflow", forgeflow.__version__)'))"
