"""The flows' ledger writes (issue 34): ``record_rows`` migrates the store once per process, never per row, and
the canary writes each agent trial once, with its supervision event, in one transaction (task bodies called
directly: no Prefect server needed)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from alembic import command

from forgeflow.ledger.records import JobRecord, TrialRecord
from forgeflow.ledger.store import Store, head_revision
from tests.helpers import store_revision


def test_record_rows_runs_alembic_once_per_store_not_per_call(tmp_path: Path, monkeypatch) -> None:
    """Before: every ``record_rows`` call ran Alembic's upgrade (10-35 ms per validation and canary trial)."""
    from tasks.common import record_rows

    upgrades: list[str] = []
    real = command.upgrade
    monkeypatch.setattr(command, "upgrade", lambda config, revision, **kw: (upgrades.append(revision),
                                                                           real(config, revision, **kw))[1])
    url = f"sqlite:///{tmp_path / 'store.db'}"
    record_rows.fn(url, "jobs", [JobRecord(job_id="j1", kind="canary")])
    for n in range(5):
        assert record_rows.fn(url, "trials", [TrialRecord(trial_id=f"t{n}", instance_id="i", kind="nop", job_id="j1",
                                                          reward=0.0)]) == 1
    assert upgrades == ["head"]
    store = Store(url)
    assert store_revision(store) == head_revision() and store.counts()["trials"] == 5
    with store.engine.begin() as connection:  # a store moved off the head under the process is migrated again
        command.downgrade(store.alembic_config(connection), "0009")
    record_rows.fn(url, "trials", [TrialRecord(trial_id="t9", instance_id="i", kind="nop", reward=1.0)])
    assert upgrades == ["head", "head"] and store_revision(store) == head_revision()
    store.dispose()


def test_a_canary_trial_and_its_supervision_event_are_written_once_together(tmp_path: Path) -> None:
    from forgeflow.sandbox.trial import TrialResult
    from tasks.evaluation import record_agent_trial

    url = f"sqlite:///{tmp_path / 'store.db'}"
    looped = TrialResult(trial_id="canary-j.calc-1", instance_id="calc-1", kind="agent", reward=0.0,
                         exception_type="AgentLoopError", exception_message="same action 3 times",
                         started_at=datetime(2026, 12, 7, tzinfo=UTC), env_setup_s=0.3, agent_s=4.0, verifier_s=1.0,
                         agent_steps=3, supervision={"kind": "dead_loop", "evidence": {"period": 1},
                                                     "trajectory_path": "/t/calc-1.traj.json"})
    for _ in range(2):  # a cached trial replayed by a resumed run upserts the same rows
        event = record_agent_trial(url, looped, "canary-j", "c" * 64, "run-1", "task-run-1")
    store = Store(url)
    (row,) = store.trials_for()
    assert (row.job_id, row.model_sha256, row.run_id, row.exception_type, row.reward, row.agent_steps) == (
        "canary-j", "c" * 64, "run-1", "AgentLoopError", 0.0, 3)
    (stored,) = store.supervision_events()
    assert stored.event_id == event.event_id and stored.kind == "dead_loop" and stored.trial_id == row.trial_id
    assert stored.evidence["period"] == 1 and stored.run_id == "task-run-1"
    store.dispose()
