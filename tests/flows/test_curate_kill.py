"""Killing the curate flow mid-batch (SIGKILL to its process group) and running it again loses no
finished trial, duplicates none and leaves no container of ours behind.

The flow runs in a subprocess pointed at the session harness's Prefect API (PREFECT_API_URL), on
three real generated inflection candidates (task images built as the lifecycle does, read in the
lifecycle's ``candidates.jsonl`` format), NOP/Oracle in podman, one batch of three, two
validations at a time. The kill comes once the first validation's trials are in the store, while
the batch still runs (no batch row; a verdict for at most the candidates already validated).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

RUN = """
import sys
from pathlib import Path
from flows.curate import CurateParams, curate
from forgeflow.curation.curate_settings import CurateSettings
from forgeflow.curation.freeze import SplitQuotas
from forgeflow.curation.task_rows import TaskSource
out = curate(CurateParams(source=TaskSource(generated_path=Path(sys.argv[1])),
             settings=CurateSettings(batch_size=3, concurrency=2, max_retries=0, verifier_timeout_s=120, seed=0),
             quotas=SplitQuotas(train=3, validation=0, test=0, min_repos=1, max_per_repo=4)))
print("RESULT " + out.model_dump_json())
"""


def _our_containers(names: set[str]) -> list[str]:
    """Names of ours left at any layer: podman's records, the OCI runtime's containers (a SIGKILLed
    ``podman run`` can leave one in state "created" that ``podman ps -a`` does not list) and conmon."""
    from forgeflow.sandbox.podman_layers import find_leftovers

    left = find_leftovers(names.__contains__)
    return sorted({*left.podman, *(name for *_, name in left.runtime), *(name for _, name in left.conmon)})


def _remove_containers(names: set[str]) -> None:
    """Remove containers of these names at every layer (trial ids are deterministic: an earlier failed
    run of this test may have left some, and a failing assertion here must not leave any)."""
    from forgeflow.sandbox.podman_layers import sweep_containers

    sweep_containers(names.__contains__)


def test_curate_killed_mid_batch_resumes_without_loss_or_duplicates(prefect_harness, tmp_path: Path) -> None:
    from prefect.settings import PREFECT_API_URL

    from forgeflow.common.settings import apply_container_env
    from forgeflow.curation.generated import build_generated, write_generated
    from forgeflow.ledger.store import Store
    from forgeflow.sandbox.trial import container_name, make_trial_id

    apply_container_env()
    rows = build_generated(["inflection"], tmp_path / "work", 3)
    assert len(rows) == 3
    generated = write_generated(tmp_path / "candidates.jsonl", rows)
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value()), "PREFECT_HOME": str(tmp_path / "prefect"),
           "FORGEFLOW_HOME": str(tmp_path / "home"), "FORGEFLOW_STORE_URL": store_url, "PYTHONUNBUFFERED": "1"}
    ours = {container_name(r.instance_id, kind, make_trial_id(r.instance_id, kind, r.image_ref, "curate-a0"))
            for r in rows for kind in ("nop", "oracle")}
    _remove_containers(ours)
    store = Store(store_url)
    store.upgrade()

    def start(log: Path) -> subprocess.Popen:
        with log.open("w") as out:
            return subprocess.Popen([sys.executable, "-c", RUN, str(generated)], env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True, cwd=Path(__file__).parents[2])

    first = start(tmp_path / "first.log")
    try:
        deadline = time.monotonic() + 240
        recorded: dict = {}
        while time.monotonic() < deadline and first.poll() is None and not recorded:
            recorded = {t.trial_id: t for t in store.trials_for(job_id="curate")}
            time.sleep(0.2)
        tail = (tmp_path / "first.log").read_text()[-3000:]
        assert first.poll() is None, f"the flow ended before the kill:\n{tail}"
        assert recorded, f"no validation finished in time:\n{tail}"
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        killed_at = datetime.now(UTC)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait(timeout=30)

    # killed mid-batch: some trials are stored, a verdict for at most some candidates, no batch row yet
    recorded = {t.trial_id: t for t in store.trials_for(job_id="curate")}
    finished = {t.instance_id for t in recorded.values()}
    verdicts_before = {t.instance_id for t in store.tasks() if t.status != "candidate"}
    assert 1 <= len(finished) < len(rows), f"{finished}:\n{tail}"
    assert len(verdicts_before) < len(rows), f"the batch ended before the kill:\n{tail}"
    assert not [b for b in store.batches() if b.kind == "curate"], f"the batch ended before the kill:\n{tail}"
    print(f"stored before the kill: {sorted(finished)}; containers left: {_our_containers(ours) or 'none'}")

    second = start(tmp_path / "second.log")
    try:
        assert second.wait(timeout=300) == 0, (tmp_path / "second.log").read_text()[-3000:]
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
    log = (tmp_path / "second.log").read_text()
    result = json.loads(log.split("RESULT ", 1)[1].splitlines()[0])
    # the quotas need every candidate accepted (feasible, so curate starts): ready or exhausted after one
    # batch: the candidates the killed run left without a verdict (those with one are not validated again)
    assert result["status"] in {"exhausted", "freeze-ready"} and len(result["batches"]) == 1
    assert not verdicts_before & set(result["validated"]), (verdicts_before, result["validated"])
    assert set(result["validated"]) == {r.instance_id for r in rows} - verdicts_before
    assert ("STOPPED, NOT READY" in log) == (result["status"] == "exhausted")

    trials = store.trials_for(job_id="curate", include_void=True)
    per_task = Counter((t.instance_id, t.kind) for t in trials)  # at most 2 NOP and 2 Oracle runs per task
    assert all(n <= 2 for (_, kind), n in per_task.items()), \
        f"duplicated trials: {sorted(per_task.items())}"  # none duplicated
    assert len({t.trial_id for t in trials}) == len(trials)
    assert {t.instance_id for t in trials if t.kind == "nop"} == {r.instance_id for r in rows}
    # each trial is stored the moment it ends, so the kill can leave a validation half done (its NOP
    # stored, its Oracle runs not): that validation runs again under the same trial ids (upserted, never
    # duplicated). A validation that had ended before the kill is kept as it was, not run again.
    before_per_task = Counter(t.instance_id for t in recorded.values())
    after_per_task = Counter(t.instance_id for t in trials)
    for trial_id, before in recorded.items():
        after = next(t for t in trials if t.trial_id == trial_id)
        assert (after.reward, after.exception_type) == (before.reward, before.exception_type)
        if before_per_task[before.instance_id] == after_per_task[before.instance_id]:  # ended before the kill
            assert after.created_at == before.created_at and after.created_at.replace(tzinfo=UTC) < killed_at
    statuses = {t.instance_id: t.status for t in store.tasks()}
    assert set(statuses) == {r.instance_id for r in rows} and "candidate" not in statuses.values()
    left = _our_containers(ours)
    _remove_containers(ours)
    assert left == [], "an orphaned trial container of ours is left"
    store.dispose()
