"""Test-wide environment (a throwaway PREFECT_HOME and FORGEFLOW_HOME, Prefect analytics off) and the
test tiers.

The environment is set before anything imports Prefect. Machine-wide caches (FORGEFLOW_CACHE: the debootstrap base
rootfs, pinned sdists, the tokenizer) are shared with the demo on purpose: they are content-
addressed and verified, and rebuilding them per run would cost minutes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
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
    # a 100,000-trial store filled once for the two (14-28 s of setup on two busy cores): issue 34's scale checks
    "tests/core/ledger/test_ledger_scale.py::test_every_user_facing_read_uses_an_index_and_loads_only_what_it_shows",
    "tests/core/ledger/test_ledger_scale.py::test_scoped_reads_at_100k_use_an_index_and_build_one_record_per_row_shown",
}
"""Tests in an otherwise fast folder that take minutes: ``slow``, out of the unit tier."""
XDIST_GROUPS = {
    # each starts a Ray head (a dozen processes, a job server that must answer within 180 s) or checks that no
    # ``ff-episode`` container is left on the machine: one worker runs them one after another
    "ray-and-episodes": frozenset({"flows/test_curate_ray.py", "flows/test_rewards_ray.py", "flows/test_ppo_flow.py",
                                   "flows/test_rl_agentic.py", "integration/test_rl_episodes_ray.py",
                                   "integration/test_rl_episodes.py"}),
}
"""Test files that share a pytest-xdist worker (``--dist loadgroup``); every other file is a group of its own,
so its module-scoped fixtures are built once (scripts/test.sh runs the suite on several workers)."""
HEAVY_FIRST = ("flows/test_lifecycle.py", "ray-and-episodes", "flows/test_service.py", "flows/test_canary_flow.py",
               "flows/test_promote_flow.py", "integration/test_freeze_reproducible.py",
               "resilience/test_concurrency_slot_kill.py", "resilience/test_concurrency_slot_restart.py",
               "integration/test_model_chain.py", "adversarial/test_red_team_3.py", "adversarial/test_red_team_2.py",
               "flows/test_training_flows.py", "flows/test_windows_flow.py", "core/training/test_burst_packing.py",
               "integration/test_vl_serving.py")
"""The groups that take longest (slowest-first, measured on a whole-suite run with ``--durations``), collected
first: ``--dist loadgroup`` hands groups to idle workers in collection order, so the long ones start at once and
the short ones fill in around them (longest-processing-time-first scheduling)."""
POSTGRESQL_FIXTURES = frozenset({"pg_cluster", "postgres_url"})
"""A test that asks for one of these, or for ``store_url``'s ``postgresql`` parameter (tests/pgfixtures.py),
runs on a real PostgreSQL server: ``integration`` (its SQLite twin stays ``unit``)."""
NOT_IN_UNIT_PROGRAMS = frozenset({"podman", "skopeo", "buildah", "docker-registry", "llama-server", "initdb",
                                  "postgres", "pg_ctl"})
"""Programs a ``unit`` test may not start (:func:`unit_tier_guard`): the integration tier's tools. A stand-in
script of the same name in a temporary folder (a test's ``tmp_path`` first on ``PATH``) may run."""
PREFECT_SERVER_APP = "prefect.server.api.server:create_app"
"""The uvicorn app every Prefect server runs (the ephemeral one, the test harness's, ``prefect server start``'s)."""


def _is_stand_in(program: str) -> bool:
    """Whether ``program`` (a name looked up on ``PATH``, or a path) is a script under the temporary folder."""
    found = shutil.which(program)
    return found is not None and Path(found).resolve().is_relative_to(Path(tempfile.gettempdir()).resolve())


def unit_tier_refusal(args: object) -> str | None:
    """Why a ``unit`` test may not start this command, or None when it may.

    Args:
        args: the command as ``subprocess.Popen`` takes it: a sequence of str/bytes/path-likes or one string.

    Returns:
        a one-line reason naming the program (a podman-like tool of :data:`NOT_IN_UNIT_PROGRAMS`, or a
        Prefect server), or None.
    """
    argv = [os.fsdecode(a) for a in ([args] if isinstance(args, (str, bytes, os.PathLike)) else args)]
    if not argv:
        return None
    words = argv[0].split()
    program = os.path.basename(words[0]) if words else ""
    if program in NOT_IN_UNIT_PROGRAMS and not _is_stand_in(words[0]):
        return f"a unit test started {program!r} ({' '.join(argv)[:200]}): mark it integration"
    if any(PREFECT_SERVER_APP in a for a in argv) or ("prefect" in program and "server" in argv):
        return f"a unit test started a Prefect server ({' '.join(argv)[:200]}): mark it flow"
    return None


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's worker hook, which reads xdist_group into the node id
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its tier, by folder, so no test file repeats it, and with its xdist group
    (:data:`XDIST_GROUPS`, else its file).

    tests/flows/ is ``flow``, tests/integration/ and tests/adversarial/ ``integration``, and so is a test
    on a real PostgreSQL server (:data:`POSTGRESQL_FIXTURES`); one of :data:`SLOW_TESTS` is ``slow``; a test with
    none of ``flow``, ``integration``, ``slow`` or ``gpu`` (by folder or its own marks) is ``unit``:
    it needs no podman and no Prefect server (``python3 -m pytest -m unit``). The :data:`HEAVY_FIRST` groups
    are moved to the front, each keeping its tests' order.
    """
    rank: dict[str, int] = {}
    for item in items:
        try:
            parts = Path(str(item.path)).resolve().relative_to(TESTS).parts
        except ValueError:  # a test outside tests/ (e.g. a sub-pytest's tmp tree)
            continue
        path = "/".join(parts)
        group = next((name for name, files in XDIST_GROUPS.items() if path in files), path)
        item.add_marker(pytest.mark.xdist_group(group))
        rank[item.nodeid] = HEAVY_FIRST.index(group) if group in HEAVY_FIRST else len(HEAVY_FIRST)
        tier = FOLDER_TIERS.get(parts[0]) if len(parts) > 1 else None
        if tier is not None:
            item.add_marker(tier)
        node = "tests/" + "/".join(parts) + "::" + item.name
        if node in SLOW_TESTS:
            item.add_marker("slow")
        callspec = getattr(item, "callspec", None)
        on_postgresql = callspec is not None and callspec.params.get("store_url") == "postgresql"
        if on_postgresql or POSTGRESQL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker("integration")
        if not NOT_UNIT & {mark.name for mark in item.iter_markers()}:
            item.add_marker("unit")
    items.sort(key=lambda item: rank.get(item.nodeid, len(HEAVY_FIRST)))  # stable: a file's order is kept


@pytest.fixture(autouse=True)
def unit_tier_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Fail a ``unit`` test that starts podman, skopeo, docker-registry, llama-server or a Prefect server.

    Every child process goes through ``subprocess.Popen`` (``run``, ``check_output``, asyncio's
    subprocesses), so its ``_execute_child`` is wrapped for the test: a refused command raises
    ``pytest.fail`` (a BaseException, which ``except Exception`` in the code under test does not
    swallow) before anything starts, and is reported again at teardown should something catch it anyway.

    Yields:
        the reasons refused so far in this test (a test of the guard empties it); empty and unused for a
        test of another tier.
    """
    refused: list[str] = []
    if request.node.get_closest_marker("unit") is None:
        yield refused
        return
    execute_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def guarded(self: subprocess.Popen, args: object, *rest: object, **kwargs: object) -> object:
        reason = unit_tier_refusal(args)
        if reason is not None:
            refused.append(reason)
            pytest.fail(reason, pytrace=False)
        return execute_child(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "_execute_child", guarded)
    yield refused
    if refused:
        pytest.fail("; ".join(refused), pytrace=False)
