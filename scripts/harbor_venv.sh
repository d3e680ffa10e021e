#!/usr/bin/env bash
# Create (or reuse) the virtualenv that holds Harbor, forgeflow's interop target.
#
# Harbor is a tool, not a library of forgeflow: it needs Python >= 3.12 (forgeflow runs on 3.11),
# so it lives in its own venv, made with pyenv's 3.12, at $FORGEFLOW_HARBOR_VENV (default
# ~/.cache/forgeflow/harbor-venv). podman-compose >= 1.1 comes from PyPI: Debian's 1.0.3 lacks the
# `--in-pod` option Harbor's podman environment passes.
#
# Idempotent: a venv whose installed harbor and podman-compose already match the pins is reused
# (checked with importlib.metadata, no network). Prints the venv's bin/harbor path on its last line.
set -euo pipefail

HARBOR_VERSION=${HARBOR_VERSION:-0.25.0}
PODMAN_COMPOSE_VERSION=${PODMAN_COMPOSE_VERSION:-1.6.0}
PY312=${HARBOR_PYTHON:-$HOME/.pyenv/versions/3.12.1/bin/python}
VENV=${FORGEFLOW_HARBOR_VENV:-${FORGEFLOW_CACHE:-$HOME/.cache/forgeflow}/harbor-venv}

installed_versions() {
  "$VENV/bin/python" - <<'EOF' 2>/dev/null
from importlib.metadata import version
print(version("harbor"), version("podman-compose"))
EOF
}

if [ -x "$VENV/bin/harbor" ] && [ "$(installed_versions)" = "$HARBOR_VERSION $PODMAN_COMPOSE_VERSION" ]; then
  echo "harbor_venv: reusing $VENV (harbor $HARBOR_VERSION, podman-compose $PODMAN_COMPOSE_VERSION)" >&2
  echo "$VENV/bin/harbor"
  exit 0
fi

if [ ! -x "$PY312" ]; then
  echo "harbor_venv: Python 3.12 not found at $PY312 (install it with pyenv, or set HARBOR_PYTHON)" >&2
  exit 1
fi
echo "harbor_venv: creating $VENV with $("$PY312" -V) (harbor==$HARBOR_VERSION, podman-compose==$PODMAN_COMPOSE_VERSION)" >&2
rm -rf "$VENV"
"$PY312" -m venv "$VENV"
# (pip's notes about this machine's missing local index folders are filtered out; errors are kept)
"$VENV/bin/python" -m pip install -q "harbor==$HARBOR_VERSION" "podman-compose==$PODMAN_COMPOSE_VERSION" 2>&1 \
  | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
installed=$(installed_versions)
if [ "$installed" != "$HARBOR_VERSION $PODMAN_COMPOSE_VERSION" ]; then
  echo "harbor_venv: after install the venv holds '$installed', expected '$HARBOR_VERSION $PODMAN_COMPOSE_VERSION'" >&2
  exit 1
fi
echo "$VENV/bin/harbor"
