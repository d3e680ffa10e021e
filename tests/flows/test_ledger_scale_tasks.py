"""The tasks' side of the ledger at scale (issue 34), task bodies called directly (no Prefect server needed):

* the canary's record path (:func:`tasks.evaluation.record_agent_trial`): trials that end together share
  transactions (a group commit), each call returning once its own trial is committed; a bad trial is refused
  before it can fail anyone else's transaction;
* curate's reads of task rows (``task_verdicts``, ``accepted_for_freeze``): only the ids asked for and the images
  they name, never every row of the store; the evaluation tasks read through the process's one store.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import pytest

from forgeflow.common.errors import InputError
from forgeflow.ledger import tasks_ledger
from forgeflow.ledger.records import BatchRecord, ImageRecord, TaskRecord
from forgeflow.ledger.store import Store


def _result(k: int, **update):
    from forgeflow.sandbox.trial import TrialResult

    return TrialResult(**{"trial_id": f"canary-j.task-{k}", "instance_id": f"task-{k}", "kind": "agent", "reward": 1.0,
                          "started_at": datetime(2026, 12, 7, tzinfo=UTC), "env_setup_s": 0.3, "agent_s": 4.0,
                          "verifier_s": 1.0, "agent_steps": 3, "submission": "diff", **update})


def test_canary_trials_that_end_together_share_transactions_and_each_is_stored_when_its_call_returns(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: one transaction per trial (1,589 trials/s at best on 2 cores, ``benchmarks.scale_ledger``). Eight
    threads record 25 trials each while every write takes 20 ms (a slow disk): the 200 trials go in far fewer
    transactions, and each thread finds its trial in the store (another connection) as soon as its call returns."""
    from tasks.common import shared_store
    from tasks.evaluation import record_agent_trial

    url = f"sqlite:///{tmp_path / 'store.db'}"
    store = shared_store(url)
    writes: list[int] = []
    real = store.record_trials

    def slow_write(trials, events=()):
        time.sleep(0.02)
        writes.append(len(trials))
        real(trials, events)

    monkeypatch.setattr(store, "record_trials", slow_write)
    reader = Store(url)
    missing: list[str] = []
    start = threading.Barrier(8)

    def record(n: int) -> None:
        start.wait()
        for k in range(n * 25, n * 25 + 25):
            result = _result(k)
            record_agent_trial(url, result, "canary-j", "c" * 64, "run-1")
            if not reader.trials_for(trial_ids=[result.trial_id]):
                missing.append(result.trial_id)

    threads = [threading.Thread(target=record, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert missing == [], "a call returned before its trial was committed"
    assert sum(writes) == 200 and len(writes) <= 60 and max(writes) > 1, writes
    looped = _result(900, exception_type="AgentLoopError", exception_message="same action 3 times",
                     supervision={"kind": "dead_loop", "evidence": {"period": 1}, "trajectory_path": "/t/x.json"})
    event = record_agent_trial(url, looped, "canary-j", "c" * 64, "run-1", "task-run-1")
    with pytest.raises(InputError, match="must have exactly one of reward"):
        record_agent_trial(url, _result(901).model_copy(update={"reward": None}), "canary-j", "c" * 64, "run-1")
    assert reader.counts()["trials"] == 201 and [e.event_id for e in reader.supervision_events()] == [event.event_id]
    reader.dispose()


def test_curate_reads_only_the_task_rows_and_images_it_asks_for(tmp_path: Path, monkeypatch) -> None:
    """Before: ``task_verdicts`` built every task row of the store and ``accepted_for_freeze`` every accepted
    task and every image (quadratic over a curate run of a growing store)."""
    from tasks.common import shared_store
    from tasks.curation import accepted_for_freeze, task_verdicts

    url = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.setenv("FORGEFLOW_STORE_URL", url)
    store = shared_store(url)
    digest = "sha256:" + "a" * 64
    for n in range(0, 300, 3):  # task n's image is recorded when n is a multiple of 3
        store.record_image(ImageRecord(ref=f"reg/task:{n}", role="task", digest=digest))
    tasks = [TaskRecord(instance_id=f"repo{n % 3}__t{n:04d}", repo=f"repo{n % 3}",
                        status="accepted" if n % 2 == 0 else "rejected", image_ref=f"reg/task:{n}")
             for n in range(1000)]
    store.record_batch_results(BatchRecord(batch_id="load", kind="load", instance_ids=[t.instance_id for t in tasks],
                                           concurrency=1), [], tasks)
    built = Counter()

    class CountedTaskRecord(TaskRecord):
        def model_post_init(self, context: object) -> None:
            built["tasks"] += 1

    class CountedImageRecord(ImageRecord):
        def model_post_init(self, context: object) -> None:
            built["images"] += 1

    monkeypatch.setattr(tasks_ledger, "TaskRecord", CountedTaskRecord)
    monkeypatch.setattr(tasks_ledger, "ImageRecord", CountedImageRecord)
    wanted = ["repo1__t0001", "repo0__t0000", "repo2__t0002"]
    verdicts = task_verdicts.fn(url, wanted)
    assert list(verdicts) == wanted and [v.status for v in verdicts.values()] == ["rejected", "accepted", "accepted"]
    assert built == {"tasks": 3}
    with pytest.raises(InputError, match="no task row for 1 id"):
        task_verdicts.fn(url, ["repo0__t0000", "nowhere__1"])
    built.clear()
    rows = accepted_for_freeze.fn(wanted)
    assert [(r.instance_id, r.image_ref, r.image_digest) for r in rows] == [
        ("repo0__t0000", "reg/task:0", digest), ("repo2__t0002", "reg/task:2", None)]
    assert built == {"tasks": 2}, "every image or accepted task of the store was read"
    from forgeflow.common import settings  # the tasks' store: this process's one, not a new one per call

    assert shared_store(settings.store_url()) is shared_store(settings.store_url()) is shared_store(url)
