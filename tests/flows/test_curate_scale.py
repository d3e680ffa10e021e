"""curate at the team's scale, without a server: the per-batch state reads only the run's own candidates
(in chunks, whatever the store holds besides), and the freeze-ready event's payload names the run's
candidate set instead of carrying its ids, whose ids the freeze reads back from the store."""

from __future__ import annotations

import json
import re
from pathlib import Path

from sqlalchemy import event


def _fill(store, ours: dict[str, str], others: dict[str, str]) -> None:
    from forgeflow.ledger.records import BatchRecord, TaskRecord

    rows = [TaskRecord(instance_id=iid, repo=iid.split(".")[0], patch="p", status=status)
            for iid, status in {**ours, **others}.items()]
    store.record_batch_results(BatchRecord(batch_id="fill", kind="load", instance_ids=[r.instance_id for r in rows],
                                           concurrency=1), [], rows)


def test_curation_state_reads_only_the_runs_ids_in_chunks_and_the_event_names_a_candidate_set(
        tmp_path: Path, monkeypatch) -> None:
    from flows.curate import freeze_ready_payload
    from forgeflow.common.errors import InputError
    from forgeflow.curation import run_reads
    from forgeflow.curation.freeze import SplitQuotas
    from forgeflow.ledger.store import Store
    from tasks import curation as curate_tasks
    from tasks.common import shared_store

    url = f"sqlite:///{tmp_path / 'store.db'}"
    store = Store(url)
    store.upgrade()
    ours = {"a.1": "accepted", "a.2": "rejected", "b.1": "accepted", "b.2": "candidate", "c.1": "error"}
    others = {f"{repo}.x{i}": "accepted" for repo in ("a", "b", "z") for i in range(40)}  # other runs' rows
    _fill(store, ours, others)

    statements: list[tuple[str, tuple]] = []
    engine = shared_store(url).engine  # the store the task reads through
    listener = lambda conn, cursor, sql, params, context, many: statements.append((sql, tuple(params)))  # noqa: E731
    event.listen(engine, "before_cursor_execute", listener)
    monkeypatch.setattr(run_reads, "IDS_PER_QUERY", 2)
    try:
        state = curate_tasks.curation_state.fn(url, sorted(ours))
    finally:
        event.remove(engine, "before_cursor_execute", listener)
    assert [t.instance_id for t in state.accepted] == ["a.1", "b.1"]
    assert state.processed == {"a.1", "a.2", "b.1", "c.1"} and state.accepted_per_repo == {"a": 1, "b": 1}
    # three chunked primary-key lookups, each bound to this run's ids only (never a scan of other runs' rows)
    reads = [(sql, params) for sql, params in statements  # (the shared store's own migration check aside)
             if sql.lstrip().upper().startswith("SELECT") and "alembic_version" not in sql]
    assert len(reads) == 3 and all(re.search(r"task_instances\.instance_id IN", sql) for sql, _ in reads)
    assert {p for _, params in reads for p in params} - {"candidate"} == set(ours)

    # the run's candidate set: recorded once, read back by the freeze, named (not listed) by the event
    many = [f"r{i // 20:04d}.c{i:05d}" for i in range(30_000)]
    registered = []
    for ids in (sorted(ours), many):
        record = run_reads.candidate_set_record(ids, "run-1")
        store.record_batch(record)
        registered.append(curate_tasks.Registration(new=0, candidates=len(ids), candidate_set=record.batch_id,
                                                    candidates_sha256=run_reads.candidate_set_digest(ids)))
    assert run_reads.candidate_set_ids(engine, registered[1].candidate_set) == sorted(many)
    quotas = SplitQuotas(train=350, validation=75, test=75, max_per_repo=20, min_repos=70)
    sizes = []
    for reg in registered:
        payload = freeze_ready_payload("sqlite:///x.db", "team-v7", quotas, 3, reg, "0" * 36,
                                       {"train": 350, "validation": 75, "test": 75}, 500, 750)
        assert payload["candidate_set"] == reg.candidate_set and payload["candidates"] == reg.candidates
        sizes.append(len(json.dumps(payload)))
    assert sizes[1] - sizes[0] <= 8 and sizes[1] < 1_024  # 5 or 30,000 candidates: the same but a count's digits
    try:
        run_reads.candidate_set_ids(engine, "candidates-" + "0" * 32)
    except InputError as exc:
        assert "no candidate set" in str(exc)
    else:
        raise AssertionError("an unknown candidate set was answered")
    store.dispose()


def test_the_freeze_on_ready_automation_hands_the_freeze_the_events_candidate_set() -> None:
    from uuid import uuid4

    from deployments import automations
    from tests.flows.test_automations import _render

    payload = {"store_url": "sqlite:///x.db", "freeze_name": "team-v7", "seed": 3, "run_id": "r",
               "quotas": {"train": 5, "validation": 0, "test": 3, "max_per_repo": 7, "min_repos": 2},
               "candidate_set": "candidates-" + "ab" * 16, "candidates_sha256": "cd" * 32, "candidates": 30_000,
               "counts": {"train": 5}, "accepted": 8, "batches": 750}
    (action,) = automations.freeze_on_ready(str(uuid4())).actions
    rendered = _render(action.parameters, {"event": {"payload": payload}})
    assert rendered == {"params": {"name": "team-v7", "quotas": payload["quotas"], "seed": 3,
                                   "candidate_set": payload["candidate_set"]}}
