"""``curate`` with a ``forgeflow-sandbox`` block of kind ``kubernetes`` against a loopback fake of the
Kubernetes API (tests/fakes/kubernetes_api.py). It is a fake of the API, not a cluster: it serves
the pod endpoints the official ``kubernetes`` client calls (create, status, exec over the websocket
``v4.channel.k8s.io`` protocol, delete, list by label) and runs each pod's container with podman.

The same candidates (test_curate.py's: two swesmith bugs of two pinned projects) are curated once on
podman and once as pods: the verdicts, the trials per candidate and the measured FAIL_TO_PASS /
PASS_TO_PASS are the same, and no pod is left. A curate run whose process gets SIGTERM (how a
worker cancels a flow run) in the middle of a batch leaves no pod behind either; on podman (no block)
a run SIGKILLed mid-batch leaves no container of its own at any layer (podman's records, the
runtime's, conmon) once its crash hook ran.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from forgeflow.curation.curate_result import CurateResult
from tests.flows.test_curate import candidates_jsonl  # noqa: F401 - the module fixture
from tests.kubefake import kubernetes_api

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _curate(candidates: Path, store_url: str, block: str, monkeypatch) -> tuple[CurateResult, list, list]:
    from flows.curate import CurateParams, curate
    from forgeflow.curation.curate_settings import CurateSettings
    from forgeflow.curation.freeze import SplitQuotas
    from forgeflow.curation.task_rows import TaskSource
    from forgeflow.ledger.store import Store

    monkeypatch.setenv("FORGEFLOW_STORE_URL", store_url)
    quotas = SplitQuotas(train=2, validation=0, test=2, min_repos=2, max_per_repo=2)
    out = curate(CurateParams(source=TaskSource(candidates_path=candidates), quotas=quotas, sandbox=block,
                 settings=CurateSettings(batch_size=4, concurrency=2, max_retries=0, verifier_timeout_s=170.0)))
    store = Store()
    trials, tasks = store.trials_for(include_void=True), store.tasks()
    store.dispose()
    return out, trials, tasks


def _accounting(trials: list, tasks: list) -> dict:
    return {
        "status": sorted((t.instance_id, t.status) for t in tasks),
        "trials": Counter((t.instance_id, t.kind) for t in trials),
        "exceptions": sorted((t.instance_id, t.kind, t.exception_type) for t in trials if t.exception_type),
        "fail_to_pass": sorted((t.instance_id, tuple(t.FAIL_TO_PASS or ())) for t in tasks),
        "pass_to_pass": sorted((t.instance_id, len(t.PASS_TO_PASS or ())) for t in tasks),
    }


def test_curate_on_kubernetes_pods_gives_the_same_accounting_as_podman(
        prefect_harness, candidates_jsonl: Path, tmp_path: Path, monkeypatch) -> None:  # noqa: F811
    from blocks.core import SandboxBackend

    monkeypatch.setenv("FORGEFLOW_HOME", str(tmp_path / "home"))
    tag = uuid.uuid4().hex[:8]  # blocks of this run's own: the block is part of the validations' cache key
    SandboxBackend(kind="podman", memory_mb=1024, cpus=1.0).save(f"podman-{tag}", overwrite=True)
    _, podman_trials, podman_tasks = _curate(candidates_jsonl, f"sqlite:///{tmp_path / 'podman.db'}",
                                             f"podman-{tag}", monkeypatch)
    with kubernetes_api(tmp_path) as fake:
        SandboxBackend(kind="kubernetes", memory_mb=1024, cpus=1.0, kubeconfig=str(fake.kubeconfig),
                       namespace="forgeflow").save(f"k8s-{tag}", overwrite=True)
        out, trials, tasks = _curate(candidates_jsonl, f"sqlite:///{tmp_path / 'k8s.db'}", f"k8s-{tag}", monkeypatch)
        assert fake.pods() == [], "a trial pod was left behind"
        assert fake.containers() == []
    assert out.status in ("exhausted", "freeze-ready") and out.trials_recorded == len(trials) > 0
    assert len(tasks) == 4 and all(t.status in ("accepted", "rejected") for t in tasks), \
        [(t.instance_id, t.status, (t.reason or "")[:600]) for t in tasks if t.status not in ("accepted", "rejected")]
    assert _accounting(trials, tasks) == _accounting(podman_trials, podman_tasks)
    # the pods' names are the trials' container names: one pod per trial, each deleted after it
    assert len({t.trial_id for t in trials}) == len(trials)


RUN = """
import sys
from pathlib import Path
from flows.curate import CurateParams, curate
from forgeflow.curation.curate_settings import CurateSettings
from forgeflow.curation.freeze import SplitQuotas
from forgeflow.curation.task_rows import TaskSource
curate(CurateParams(source=TaskSource(candidates_path=Path(sys.argv[1])), sandbox=sys.argv[2] or None,
       settings=CurateSettings(batch_size=4, concurrency=2, max_retries=0, verifier_timeout_s=171.5),
       quotas=SplitQuotas(train=2, validation=0, test=2, min_repos=2, max_per_repo=2)))
"""


def test_a_cancelled_curate_run_leaves_no_pod(prefect_harness, candidates_jsonl: Path,  # noqa: F811
                                              tmp_path: Path) -> None:
    from prefect.settings import PREFECT_API_URL

    from blocks.core import SandboxBackend

    with kubernetes_api(tmp_path) as fake:
        block = f"k8s-cancel-{uuid.uuid4().hex[:8]}"
        SandboxBackend(kind="kubernetes", memory_mb=1024, kubeconfig=str(fake.kubeconfig)).save(block, overwrite=True)
        env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value()), "PREFECT_HOME": str(tmp_path / "p"),
               "FORGEFLOW_HOME": str(tmp_path / "home"), "FORGEFLOW_STORE_URL": f"sqlite:///{tmp_path / 's.db'}"}
        log = tmp_path / "cancelled.log"
        with log.open("w") as out:
            proc = subprocess.Popen([sys.executable, "-c", RUN, str(candidates_jsonl), block], env=env, stdout=out,
                                    stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            deadline = time.monotonic() + 240
            while not fake.pods():
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "no trial pod was created"
                time.sleep(0.2)
            labels = fake.pods()[0]["metadata"]["labels"]
            assert labels.get("forgeflow.dev/flow-run"), labels  # the run's id: what the sweep selects
            proc.send_signal(signal.SIGTERM)  # what a worker does to cancel a flow run
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert fake.pods() == [], f"pods left after the run ended: {fake.pods()}\n{log.read_text()[-3000:]}"
        assert fake.containers() == []


def test_a_killed_curate_run_on_podman_leaves_no_container_after_its_crash_hook(
        prefect_harness, candidates_jsonl: Path, tmp_path: Path) -> None:  # noqa: F811
    """SIGKILL to the run's process group (no cleanup of its own runs), then the flow's ``on_crashed``
    hook as Prefect's runner calls it for a run whose process died: every container the run labelled
    is ended at every layer."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    from flows.curate import curate
    from forgeflow.common.settings import tool_env
    from forgeflow.sandbox.podman_layers import find_leftovers, sweep_containers

    def labelled() -> dict[str, str]:  # name -> flow run of the podman containers a flow run labelled
        out = subprocess.run(["podman", "ps", "-a", "--filter", "label=forgeflow.dev/flow-run", "--format",
                              '{{.Names}} {{index .Labels "forgeflow.dev/flow-run"}}'], capture_output=True,
                             text=True, env=tool_env(), check=True).stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    before = labelled()
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value()), "PREFECT_HOME": str(tmp_path / "p"),
           "FORGEFLOW_HOME": str(tmp_path / "home"), "FORGEFLOW_STORE_URL": f"sqlite:///{tmp_path / 's.db'}"}
    log = tmp_path / "killed.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-c", RUN, str(candidates_jsonl), ""], env=env, stdout=out,
                                stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (ours := {n: r for n, r in labelled().items() if n not in before}):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no trial container was started"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    runs = set(ours.values())
    assert len(runs) == 1, ours  # every container names the one flow run
    assert set(labelled()) & set(ours), "the kill left no container: nothing for the hook to do"
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(UUID(runs.pop()))
    try:
        for hook in curate.on_crashed_hooks:
            hook(flow=curate, flow_run=run, state=run.state)
        left = {n for n, r in labelled().items() if r == str(run.id)}
        below = find_leftovers(lambda n: n in ours)  # runtime containers and conmons of those names too
        assert not left and below.empty(), f"left after the hook: {left} {below}\n{log.read_text()[-3000:]}"
    finally:  # a failure above must not leave them to the next test
        sweep_containers(lambda n: n in ours)
