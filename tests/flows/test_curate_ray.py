"""``curate`` with a Ray dispatcher on a real local Ray cluster: a head node without sandboxes and two
worker nodes that declare ``{"sandbox": 1}`` each, started as separate ``ray start --address``
processes (tests/raycluster.py) and stopped by PID. The validations land on both worker nodes (each
trial records its node id); then a worker node is killed with SIGKILL in the middle of a batch: Ray
runs its validation again on the surviving node, and the batch ends with every candidate validated
once, no trial lost or duplicated, no trial container left.

The candidates are test_curate.py's (two swesmith bugs of two pinned projects, real task images).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from forgeflow.curation.curate_result import CurateResult
from tests.flows.test_curate import candidates_jsonl  # noqa: F401 - the module fixture
from tests.raycluster import ray_head, ray_worker

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _running_on(dashboard_url: str, node_id: str) -> bool:
    from ray.util.state import list_tasks

    try:
        tasks = list_tasks(address=dashboard_url, filters=[("node_id", "=", node_id), ("state", "=", "RUNNING")],
                           raise_on_missing_output=False)
    except Exception:  # noqa: BLE001 - the state API not answering yet
        return False
    return any(t.name.startswith("validation of ") for t in tasks)


def _curate(candidates: Path, store_url: str, block: str, monkeypatch) -> tuple[CurateResult, list]:
    from flows.curate import CurateParams, curate
    from forgeflow.curation.curate_settings import CurateSettings
    from forgeflow.curation.freeze import SplitQuotas
    from forgeflow.curation.task_rows import TaskSource
    from forgeflow.ledger.store import Store

    monkeypatch.setenv("FORGEFLOW_STORE_URL", store_url)
    # the 4 candidates can fill these only if all are accepted: one batch of 4 validates every one
    quotas = SplitQuotas(train=2, validation=0, test=2, min_repos=2, max_per_repo=2)
    # a timeout of this run's own keeps Prefect's cache (keyed by the validation's inputs) from answering
    timeout_s = 170.0 + int(uuid.uuid4().hex[:4], 16) / 65536
    out = curate(CurateParams(source=TaskSource(candidates_path=candidates), quotas=quotas, dispatcher=block,
                 settings=CurateSettings(batch_size=4, concurrency=2, max_retries=0, verifier_timeout_s=timeout_s)))
    store = Store()
    trials = store.trials_for(include_void=True)
    store.dispose()
    return out, trials


def test_curate_spreads_validations_over_ray_nodes_and_survives_losing_one(
        prefect_harness, candidates_jsonl: Path, tmp_path: Path, monkeypatch) -> None:  # noqa: F811
    from blocks.core import TrialDispatcher
    from flows.curate import CurateParams, curate
    from forgeflow.common.errors import InputError
    from forgeflow.curation.task_rows import TaskSource

    monkeypatch.setenv("FORGEFLOW_HOME", str(tmp_path / "home"))
    with pytest.raises(InputError, match="dispatcher block 'no-such-dispatcher' does not exist"):
        curate(CurateParams(source=TaskSource(candidates_path=candidates_jsonl), dispatcher="no-such-dispatcher"))
    with ray_head(num_cpus=1) as head, ray_worker(head, {"sandbox": 1}) as one, \
            ray_worker(head, {"sandbox": 1}) as two:
        block = f"test-ray-{uuid.uuid4().hex[:8]}"
        TrialDispatcher(kind="ray", address=head.address).save(block, overwrite=True)

        out, trials = _curate(candidates_jsonl, f"sqlite:///{tmp_path / 'spread.db'}", block, monkeypatch)
        assert out.status in ("exhausted", "freeze-ready") and len(out.batches) == 1
        assert out.trials_recorded == len(trials) > 0
        nodes = Counter(t.verifier["node_id"] for t in trials if t.verifier)
        assert set(nodes) == {one.node_id, two.node_id}, nodes  # both sandbox nodes, never the head

        # SIGKILL node two while it runs a validation
        killed = threading.Event()

        def kill_two() -> None:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not _running_on(head.dashboard_url, two.node_id):
                time.sleep(0.5)
            os.killpg(two.pgid, signal.SIGKILL)
            killed.set()

        before = set(_containers())
        killer = threading.Thread(target=kill_two, daemon=True)
        killer.start()
        out, trials = _curate(candidates_jsonl, f"sqlite:///{tmp_path / 'killed.db'}", block, monkeypatch)
        killer.join(timeout=10)
        assert killed.is_set(), "node two never ran a validation"
        ids = [t.trial_id for t in trials]
        assert len(ids) == len(set(ids)), "a trial was recorded twice"
        from forgeflow.ledger.store import Store

        monkeypatch.setenv("FORGEFLOW_STORE_URL", f"sqlite:///{tmp_path / 'killed.db'}")
        tasks = Store().tasks()
        assert len(tasks) == 4 and all(t.status != "error" for t in tasks), [(t.instance_id, t.status) for t in tasks]
        nops = Counter(t.instance_id for t in trials if t.kind == "nop")  # two for an accepted task
        assert nops == Counter({t.instance_id: 1 + (t.status == "accepted") for t in tasks})
        assert {t.verifier["node_id"] for t in trials if t.verifier} <= {one.node_id, two.node_id}
        # this run's own containers (other tests' containers may run beside it)
        from forgeflow.sandbox.trial import container_name

        mine = {container_name(t.instance_id, t.kind, t.trial_id) for t in trials}
        assert not (set(_containers()) - before) & mine, "a trial container was left behind"
        import ray

        # the flow left the cluster: a driver outlived by its cluster would be ended by Ray
        assert not ray.is_initialized()


def _containers() -> list[str]:
    return subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True,
                          check=True).stdout.split()
