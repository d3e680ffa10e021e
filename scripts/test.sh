#!/usr/bin/env bash
# The test command of the README: set up (idempotent), then run the whole suite with pytest.
# Prefect gets a temporary PREFECT_HOME and analytics off; forgeflow a temporary FORGEFLOW_HOME
# (machine-wide caches such as the base rootfs stay in FORGEFLOW_CACHE, default ~/.cache/forgeflow).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export PREFECT_HOME="$tmp/prefect" PREFECT_SERVER_ANALYTICS_ENABLED=false FORGEFLOW_HOME="$tmp/forgeflow"
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=240
"${PYTHON:-python3}" -m pytest -ra "$@"
