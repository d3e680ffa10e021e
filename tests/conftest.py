"""Test-wide environment: a throwaway PREFECT_HOME and FORGEFLOW_HOME, Prefect analytics off.

Set before anything imports Prefect. Machine-wide caches (FORGEFLOW_CACHE: the debootstrap base
rootfs, pinned sdists, the tokenizer) are shared with the demo on purpose: they are content-
addressed and verified, and rebuilding them per run would cost minutes.
"""

from __future__ import annotations

import os
import tempfile

_TMP = tempfile.mkdtemp(prefix="forgeflow-tests-")
os.environ.setdefault("PREFECT_HOME", os.path.join(_TMP, "prefect"))
os.environ.setdefault("FORGEFLOW_HOME", os.path.join(_TMP, "forgeflow"))
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "240")
os.environ.setdefault("MSWEA_CONFIGURED", "true")
os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", os.path.join(_TMP, "mswea"))

# store_url / postgres_url / pg_cluster: every store test on SQLite and on PostgreSQL (tests/pgfixtures.py)
pytest_plugins = ["tests.pgfixtures"]
