"""Test-wide environment (a throwaway PREFECT_HOME and FORGEFLOW_HOME, Prefect analytics off) and the
test tiers.

The environment is set before anything imports Prefect. Machine-wide caches (FORGEFLOW_CACHE: the debootstrap base
rootfs, pinned sdists, the tokenizer) are shared with the demo on purpose: they are content-
addressed and verified, and rebuilding them per run would cost minutes.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

_TMP = tempfile.mkdtemp(prefix="forgeflow-tests-")
os.environ.setdefault("PREFECT_HOME", os.path.join(_TMP, "prefect"))
os.environ.setdefault("FORGEFLOW_HOME", os.path.join(_TMP, "forgeflow"))
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "240")
os.environ.setdefault("MSWEA_CONFIGURED", "true")
os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", os.path.join(_TMP, "mswea"))

# store_url / postgres_url / pg_cluster: every store test on SQLite and on PostgreSQL (tests/pgfixtures.py)
pytest_plugins = ["tests.pgfixtures"]


TESTS = Path(__file__).resolve().parent
FOLDER_TIERS = {"flows": "flow", "integration": "integration", "adversarial": "integration"}
"""The tier every test in a folder under tests/ carries (besides its own marks): ``flow`` (Prefect's
harness or a real Prefect server), ``integration`` (podman, registry, model servers)."""
NOT_UNIT = {"flow", "integration", "slow", "gpu"}
SLOW_TESTS = {
    # six Python processes import peft (torch, transformers): 129 s of a 478 s unit tier on two busy cores
    "tests/core/training/test_adapters.py::test_an_adapter_resaved_under_another_hash_seed_keeps_its_digest",
}
"""Tests in an otherwise fast folder that take minutes: ``slow``, out of the unit tier."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its tier, by folder, so no test file repeats it.

    tests/flows/ is ``flow``, tests/integration/ and tests/adversarial/ ``integration``; a test with
    none of ``flow``, ``integration``, ``slow`` or ``gpu`` (by folder or its own marks) is ``unit``:
    it needs no podman and no Prefect server (``python3 -m pytest -m unit``).
    """
    for item in items:
        try:
            parts = Path(str(item.path)).resolve().relative_to(TESTS).parts
        except ValueError:  # a test outside tests/ (e.g. a sub-pytest's tmp tree)
            continue
        tier = FOLDER_TIERS.get(parts[0]) if len(parts) > 1 else None
        if tier is not None:
            item.add_marker(tier)
        if "tests/" + "/".join(parts) + "::" + item.name in SLOW_TESTS:
            item.add_marker("slow")
        if not NOT_UNIT & {mark.name for mark in item.iter_markers()}:
            item.add_marker("unit")
