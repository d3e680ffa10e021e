"""Recovery by exact ids on a temp store, SQLite and PostgreSQL (no Prefect, no containers)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from pydantic import ValidationError
from sqlalchemy import text

from forgeflow.common.errors import InputError
from forgeflow.common.fsutil import sha256_file
from forgeflow.curation.recovery import (
    CountMismatchError,
    RecoveryRequest,
    apply_recovery,
    plan_recovery,
    render_audit,
    render_plan,
)
from forgeflow.ledger.records import BatchRecord, TaskRecord, TrialRecord
from forgeflow.ledger.store import Store
from tests.helpers import store_revision, task_status_counts

T0 = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)


def _trial(tid: str, iid: str, kind: str, batch: str, minutes: int, reward: float | None = None,
           exc: str | None = None) -> TrialRecord:
    return TrialRecord(trial_id=tid, instance_id=iid, kind=kind, batch_id=batch, job_id="curate",
                       reward=reward, exception_type=exc, exception_message=f"{exc} happened" if exc else None,
                       created_at=T0 + timedelta(minutes=minutes))


def _task(iid: str, status: str, reason: str = "") -> TaskRecord:
    return TaskRecord(instance_id=iid, repo=iid.split(".")[0], status=status, reason=reason,
                      FAIL_TO_PASS=["t::a"] if status == "accepted" else [])


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    """b1: a (NOP registry fault), b (accepted), c (rejected: NOP passes), d (Oracle sandbox fault);
    b2, an hour later: e (NOP OOM)."""
    ledger = Store(store_url)
    ledger.upgrade()
    ledger.record_batch(BatchRecord(batch_id="b1", kind="curate", instance_ids=["ra.a", "rb.b", "rc.c", "rd.d"],
                                    concurrency=2))
    ledger.record_batch(BatchRecord(batch_id="b2", kind="curate", instance_ids=["re.e"], concurrency=2))
    ledger.record_trials([
        _trial("a-nop", "ra.a", "nop", "b1", 0, exc="RegistryUnavailableError"),
        _trial("b-nop", "rb.b", "nop", "b1", 1, reward=0.0),
        _trial("b-oracle", "rb.b", "oracle", "b1", 2, reward=1.0),
        _trial("c-nop", "rc.c", "nop", "b1", 1, reward=1.0),
        _trial("d-nop", "rd.d", "nop", "b1", 1, reward=0.0),
        _trial("d-oracle", "rd.d", "oracle", "b1", 3, exc="SandboxError"),
        _trial("e-nop", "re.e", "nop", "b2", 60, exc="SandboxOOMError"),
    ])
    for task in (_task("ra.a", "error", "RegistryUnavailableError"), _task("rb.b", "accepted"),
                 _task("rc.c", "rejected", "no test failed"), _task("rd.d", "error", "SandboxError"),
                 _task("re.e", "error", "SandboxOOMError")):
        ledger.record_task(task)
    yield ledger
    ledger.dispose()


def test_dry_run_lists_exactly_the_faulted_trials_and_writes_nothing(store: Store) -> None:
    before = store.counts(include_void=True)
    plan = plan_recovery(store, RecoveryRequest(batch_ids=["b1"], reason="registry was down"))
    assert [t.trial_id for t in plan.void] == ["a-nop", "d-oracle"]
    assert [t.instance_id for t in plan.requeue] == ["ra.a", "rd.d"]
    assert sorted(k.trial_id for k in plan.kept) == ["b-nop", "b-oracle", "c-nop", "d-nop"]
    assert all("reward" in k.why for k in plan.kept)
    text = render_plan(plan)
    assert "void    a-nop" in text and "requeue rd.d" in text and "re.e" not in text
    assert store.counts(include_void=True) == before
    assert task_status_counts(store) == {"error": 3, "accepted": 1, "rejected": 1}


def test_apply_backs_up_voids_and_requeues_only_the_faulted_tasks(store: Store, tmp_path: Path) -> None:
    plan = plan_recovery(store, RecoveryRequest(batch_ids=["b1"], reason="registry was down"))
    # how the recover flow runs (dry_run, backup_dir) is no part of the plan: its dry run and its apply digest alike
    applied = plan_recovery(store, RecoveryRequest(batch_ids=["b1"], reason="registry was down", dry_run=False,
                                                   backup_dir=tmp_path / "elsewhere"))
    assert applied.plan_sha256 == plan.plan_sha256
    result = apply_recovery(store, plan, tmp_path / "backups", run_id="r1")

    assert result.voided == 2 and result.requeued == 2
    backup = json.loads(result.backup_path.read_text())
    assert backup["request"] == {"batch_ids": ["b1"], "trial_ids": [], "exception_type": None, "since": None,
                                 "until": None, "reason": "registry was down", "include_rejections": False}
    assert sha256_file(result.backup_path) == result.backup_sha256
    assert (tmp_path / "backups" / f"{result.backup_path.name}.sha256").read_text().split()[0] == result.backup_sha256
    assert [t["trial_id"] for t in backup["trials"]] == ["a-nop", "d-oracle"]
    assert {t["instance_id"]: t["status"] for t in backup["tasks"]} == {"ra.a": "error", "rd.d": "error"}

    # void trials are kept for audit but excluded from reads and counts
    assert [t.trial_id for t in store.trials_for(batch_id="b1")] == ["b-nop", "c-nop", "d-nop", "b-oracle"]
    voided = {t.trial_id: t for t in store.trials_for(include_void=True) if t.voided_at is not None}
    assert set(voided) == {"a-nop", "d-oracle"} and voided["a-nop"].void_reason == "registry was down"
    assert store.counts()["trials"] == 5 and store.counts(include_void=True)["trials"] == 7

    # requeued tasks are candidates again (so curate picks them up); real outcomes untouched
    assert store.get_task("ra.a").status == "candidate" and store.get_task("rd.d").status == "candidate"
    assert store.get_task("rb.b").status == "accepted" and store.get_task("rc.c").status == "rejected"
    assert store.get_task("re.e").status == "error"
    assert store.processed_instance_ids() == {"rb.b", "rc.c", "re.e"}
    assert result.after == plan.expected_after
    assert result.after.tasks_by_status == {"candidate": 2, "accepted": 1, "rejected": 1, "error": 1}

    audit = render_audit(plan, result)
    assert result.backup_sha256 in audit and "| live trials | 7 | 5 |" in audit
    assert "| a-nop | ra.a | nop | RegistryUnavailableError | b1 |" in audit

    # a second recovery of the same batch finds nothing left to do
    again = plan_recovery(store, RecoveryRequest(batch_ids=["b1"], reason="again"))
    assert again.empty and any("already void" in k.why for k in again.kept)


def test_an_exception_type_needs_a_window_and_only_that_window_is_touched(store: Store, tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="needs a time window"):
        RecoveryRequest(exception_type="SandboxOOMError", reason="oom storm")
    with pytest.raises(ValidationError, match="needs a time window"):
        RecoveryRequest(exception_type="SandboxOOMError", since=T0, reason="oom storm")
    with pytest.raises(ValidationError, match="not both"):
        RecoveryRequest(exception_type="SandboxOOMError", since=T0, until=T0 + timedelta(hours=1),
                        batch_ids=["b1"], reason="x")
    with pytest.raises(ValidationError, match="timezone-aware"):
        RecoveryRequest(exception_type="X", since=datetime(2026, 1, 1), until=datetime(2026, 1, 2), reason="x")

    early = RecoveryRequest(exception_type="SandboxOOMError", since=T0, until=T0 + timedelta(minutes=30),
                            reason="oom storm")
    assert plan_recovery(store, early).empty
    late = RecoveryRequest(exception_type="SandboxOOMError", since=T0 + timedelta(minutes=30),
                           until=T0 + timedelta(hours=2), reason="oom storm")
    late_plan = plan_recovery(store, late)
    result = apply_recovery(store, late_plan, tmp_path)
    assert [t.trial_id for t in late_plan.void] == ["e-nop"] and result.voided == 1
    assert store.get_task("re.e").status == "candidate" and store.get_task("ra.a").status == "error"


def test_a_task_whose_status_came_from_a_later_trial_is_not_requeued(store: Store, tmp_path: Path) -> None:
    store.record_batch(BatchRecord(batch_id="b3", kind="curate", instance_ids=["ra.a"], concurrency=1))
    store.record_trials([_trial("a-nop-retry", "ra.a", "nop", "b3", 90, exc="SandboxError")])
    plan = plan_recovery(store, RecoveryRequest(trial_ids=["a-nop"], reason="registry was down"))
    assert [t.trial_id for t in plan.void] == ["a-nop"] and plan.requeue == []
    apply_recovery(store, plan, tmp_path)
    assert store.get_task("ra.a").status == "error"


def test_re_recording_a_void_trial_does_not_revive_it(store: Store, tmp_path: Path) -> None:
    apply_recovery(store, plan_recovery(store, RecoveryRequest(trial_ids=["e-nop"], reason="oom")), tmp_path)
    store.record_trials([_trial("e-nop", "re.e", "nop", "b2", 60, exc="SandboxOOMError")])
    assert store.trials_for(instance_id="re.e") == []
    assert store.trials_for(instance_id="re.e", include_void=True)[0].void_reason == "oom"


def test_a_stale_plan_is_rolled_back_by_the_count_check(store: Store, tmp_path: Path) -> None:
    plan = plan_recovery(store, RecoveryRequest(batch_ids=["b1"], reason="registry was down"))
    store.record_trials([_trial("late", "rb.b", "nop", "b9", 5, reward=0.0)])  # a writer after the plan
    with pytest.raises(CountMismatchError, match="rolled back"):
        apply_recovery(store, plan, tmp_path)
    assert not [t for t in store.trials_for(include_void=True) if t.voided_at is not None]
    assert store.get_task("ra.a").status == "error"


def test_unknown_ids_are_named(store: Store) -> None:
    with pytest.raises(InputError, match="unknown trial ids \\['nope'\\]"):
        plan_recovery(store, RecoveryRequest(trial_ids=["a-nop", "nope"], reason="x"))
    with pytest.raises(InputError, match="unknown batch ids \\['b7'\\]"):
        plan_recovery(store, RecoveryRequest(batch_ids=["b7"], reason="x"))
    with pytest.raises(ValidationError, match="give batch_ids"):
        RecoveryRequest(reason="x")


def test_migration_0002_keeps_existing_trials_live(store_url: str) -> None:
    ledger = Store(store_url)
    ledger.upgrade("0001")
    with ledger.engine.begin() as connection:  # a row as a 0001 store wrote it (only 0001's columns)
        connection.execute(text(
            "INSERT INTO trials (trial_id, instance_id, batch_id, kind, reward, timings, created_at, updated_at) "
            "VALUES ('old', 'ra.a', 'b1', 'nop', 0.0, '{}', '2026-11-01 00:00:00', '2026-11-01 00:00:00')"))
    ledger.upgrade()
    from alembic.script import ScriptDirectory

    assert store_revision(ledger) == ScriptDirectory.from_config(ledger.alembic_config()).get_current_head()
    assert [t.trial_id for t in ledger.trials_for()] == ["old"] and ledger.trials_for()[0].voided_at is None
    ledger.dispose()


# --- rejections an infrastructure fault caused (include_rejections) ----------------------------
@pytest.fixture
def tunnel_store(store: Store) -> Store:
    """``store`` plus b3, the batch that ran while the build tunnel was dead: f rejected (NOP 0,
    Oracle 0), g rejected (NOP 1: "no test failed"), h accepted, i rejected with its Oracle run in
    b4 (outside b3), j errored (NOP exception). c (b1) is a real rejection."""
    store.record_batch(BatchRecord(batch_id="b3", kind="curate", instance_ids=["rf.f", "rg.g", "rh.h", "ri.i", "rj.j"],
                                   concurrency=2))
    store.record_batch(BatchRecord(batch_id="b4", kind="curate", instance_ids=["ri.i"], concurrency=1))
    store.record_trials([
        _trial("f-nop", "rf.f", "nop", "b3", 120, reward=0.0),
        _trial("f-oracle", "rf.f", "oracle", "b3", 121, reward=0.0),
        _trial("g-nop", "rg.g", "nop", "b3", 122, reward=1.0),
        _trial("h-nop", "rh.h", "nop", "b3", 123, reward=0.0),
        _trial("h-oracle", "rh.h", "oracle", "b3", 124, reward=1.0),
        _trial("i-nop", "ri.i", "nop", "b3", 125, reward=0.0),
        _trial("i-oracle", "ri.i", "oracle", "b4", 126, reward=0.0),
        _trial("j-nop", "rj.j", "nop", "b3", 127, exc="ImageBuildError"),
    ])
    for task in (_task("rf.f", "rejected", "gold patch fixes no test"), _task("rg.g", "rejected", "no test failed"),
                 _task("rh.h", "accepted"), _task("ri.i", "rejected", "gold patch fixes no test"),
                 _task("rj.j", "error", "ImageBuildError")):
        store.record_task(task)
    return store


def test_include_rejections_needs_exact_ids_never_an_exception_window() -> None:
    with pytest.raises(ValidationError, match="include_rejections needs exact batch_ids and/or trial_ids"):
        RecoveryRequest(exception_type="ImageBuildError", since=T0, until=T0 + timedelta(hours=3),
                        include_rejections=True, reason="tunnel")
    assert RecoveryRequest(batch_ids=["b3"], include_rejections=True, reason="tunnel").include_rejections


def test_without_the_option_rejections_are_kept_and_the_dry_run_says_how_to_void_them(tunnel_store: Store) -> None:
    plan = plan_recovery(tunnel_store, RecoveryRequest(batch_ids=["b3"], reason="tunnel"))
    assert [t.trial_id for t in plan.void] == ["j-nop"] and [t.instance_id for t in plan.requeue] == ["rj.j"]
    why = {k.trial_id: k.why for k in plan.kept}
    assert "include_rejections voids it" in why["f-nop"] and "include_rejections" not in why["h-oracle"]


def test_rejections_by_batch_are_voided_and_requeued_with_backup_audit_and_counts(tunnel_store: Store,
                                                                                   tmp_path: Path) -> None:
    store = tunnel_store
    before = task_status_counts(store)
    assert before == {"error": 4, "accepted": 2, "rejected": 4}
    plan = plan_recovery(store, RecoveryRequest(batch_ids=["b3"], include_rejections=True,
                                                reason="build tunnel dead 12:00-12:10"))
    assert [t.trial_id for t in plan.void] == ["f-nop", "f-oracle", "g-nop", "j-nop"]
    assert [t.instance_id for t in plan.requeue] == ["rf.f", "rg.g", "rj.j"]
    why = {k.trial_id: k.why for k in plan.kept}
    assert set(why) == {"h-nop", "h-oracle", "i-nop"}  # the accepted task and the half-selected rejection
    assert "has a reward" in why["h-oracle"] and "['i-oracle'] are not selected" in why["i-nop"]
    assert "reward 0.0 (rejection)" in render_plan(plan)

    result = apply_recovery(store, plan, tmp_path / "backups", run_id="r2")
    assert (result.voided, result.requeued) == (4, 3)
    backup = json.loads(result.backup_path.read_text())
    assert sha256_file(result.backup_path) == result.backup_sha256
    assert backup["request"]["include_rejections"] is True
    assert {t["trial_id"]: t["reward"] for t in backup["trials"]} == {"f-nop": 0.0, "f-oracle": 0.0, "g-nop": 1.0,
                                                                     "j-nop": None}
    assert {t["instance_id"]: t["status"] for t in backup["tasks"]} == {"rf.f": "rejected", "rg.g": "rejected",
                                                                      "rj.j": "error"}
    # requeued: candidates again, with nothing left of the faulty validation; everything else stays
    assert [store.get_task(i).status for i in ("rf.f", "rg.g", "rj.j")] == ["candidate"] * 3
    assert store.trials_for(instance_id="rf.f") == [] and store.trials_for(instance_id="rg.g") == []
    assert store.get_task("rc.c").status == "rejected" and store.get_task("ri.i").status == "rejected"
    assert store.get_task("rh.h").status == "accepted" and store.get_task("rb.b").status == "accepted"
    assert [t.trial_id for t in store.trials_for(instance_id="ri.i")] == ["i-nop", "i-oracle"]
    assert task_status_counts(store) == {"error": 3, "accepted": 2, "rejected": 2, "candidate": 3}
    assert result.after == plan.expected_after
    audit = render_audit(plan, result)
    assert "include_rejections" in audit and "| f-nop | rf.f | nop | none (reward 0.0) | b3 |" in audit
    assert "| tasks rejected | 4 | 2 |" in audit


def test_rejections_by_trial_ids_need_every_live_validation_trial_of_the_task(tunnel_store: Store,
                                                                               tmp_path: Path) -> None:
    store = tunnel_store
    half = plan_recovery(store, RecoveryRequest(trial_ids=["i-nop"], include_rejections=True, reason="tunnel"))
    assert half.empty and "['i-oracle'] are not selected" in half.kept[0].why
    whole = plan_recovery(store, RecoveryRequest(trial_ids=["i-nop", "i-oracle"], include_rejections=True,
                                                 reason="tunnel"))
    apply_recovery(store, whole, tmp_path)
    assert store.get_task("ri.i").status == "candidate" and store.trials_for(instance_id="ri.i") == []
    assert store.get_task("rf.f").status == "rejected"  # a rejection outside the ids stays


def test_a_task_accepted_after_the_plan_is_not_requeued(tunnel_store: Store, tmp_path: Path) -> None:
    store = tunnel_store
    plan = plan_recovery(store, RecoveryRequest(batch_ids=["b3"], include_rejections=True, reason="tunnel"))
    store.record_task(_task("rf.f", "accepted"))  # another writer accepted it after the plan
    with pytest.raises(CountMismatchError, match="rolled back"):
        apply_recovery(store, plan, tmp_path)
    assert store.get_task("rf.f").status == "accepted"
    assert not [t for t in store.trials_for(include_void=True) if t.voided_at is not None]
