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
# the house stays tidy: ruff (rules in pyproject.toml) before any test runs
"${PYTHON:-python3}" -m ruff check .
# pytest-xdist: FORGEFLOW_TEST_WORKERS workers (default 3: most tests wait on podman, servers and subprocesses, so
# three keep two cores busy; 0 runs in this process); a file's tests share a worker, and so do the files
# tests/conftest.py groups (XDIST_GROUPS)
workers=(-n "${FORGEFLOW_TEST_WORKERS:-3}" --dist loadgroup)
# --durations: the slowest tests, what tests/conftest.py's HEAVY_FIRST (the groups started first) is measured from
"${PYTHON:-python3}" -m pytest -ra --durations=30 "${workers[@]}" "$@"
# Second pass (the whole-suite run only): the Prefect server of the flow tests' harness and their store on
# PostgreSQL (a throwaway cluster on a free loopback port, tests/flows/conftest.py); the store tests above already
# ran on SQLite and PostgreSQL (tests/pgfixtures.py). About 1 minute here.
if [ "$#" -eq 0 ]; then
  FORGEFLOW_TEST_PREFECT_DB=postgresql "${PYTHON:-python3}" -m pytest -ra "${workers[@]}" tests/flows/test_prefect_database.py \
    tests/flows/test_curate.py tests/flows/test_cli_curation.py tests/flows/test_compare_cli.py
fi
