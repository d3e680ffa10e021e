"""What the curate and recover flows return (forgeflow.curation.curate_result, recovery.RecoveryResult): the keys
users read, each path's fields, and the refusals of a result that mixes two kinds."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
from pydantic import ValidationError

from forgeflow.curation.curate_result import CurateResult
from forgeflow.curation.recovery import RecoveryResult, Summary

READY = {"status": "freeze-ready", "batches": ["curate-ab"], "trials_recorded": 6, "counts": {"train": 2, "test": 1},
         "unmet": [], "event_id": "e-1", "freeze_name": "curate-0123456789ab",
         "validated": ["repo.a", "repo.b", "repo.c"]}


def test_curate_result_dumps_the_keys_the_flow_returned_as_a_dict():
    assert json.loads(CurateResult.model_validate(READY).model_dump_json()) == READY
    exhausted = CurateResult(status="exhausted", batches=[], trials_recorded=0, counts={"train": 0},
                             unmet=["train 0/2"], freeze_name="f")
    assert exhausted.event_id is None and exhausted.validated == []  # no batch ran: none validated


@pytest.mark.parametrize("change", [{"status": "ready"}, {"trials_recorded": -1}, {"unmet": ["test 1/2"]},
                                    {"status": "exhausted"}, {"status": "exhausted", "unmet": ["x"]},
                                    {"freeze_name": ""}, {"extra": 1}])
def test_curate_result_refuses_a_status_its_fields_contradict(change):
    with pytest.raises(ValidationError):
        CurateResult.model_validate({**READY, **change})


def test_recover_result_carries_the_dry_run_lists_or_what_was_done():
    dry = RecoveryResult(dry_run=True, void=["t-a"], requeue=["repo.a"], kept=["t-b"])
    assert dry.model_dump(exclude_none=True) == {"dry_run": True, "void": ["t-a"], "requeue": ["repo.a"],
                                                 "kept": ["t-b"]}
    after = Summary(trials=2, void_trials=1, tasks_by_status={"candidate": 1})
    when = datetime(2026, 12, 1, tzinfo=UTC)
    done = RecoveryResult(dry_run=False, recovery_id="recover-1", voided=1, requeued=1,
                          backup_path=Path("/r/b.json"), backup_sha256="a" * 64, after=after, voided_at=when)
    dumped = json.loads(done.model_dump_json())
    assert (dumped["backup_path"], dumped["after"]["tasks_by_status"], dumped["void"]) == ("/r/b.json",
                                                                                         {"candidate": 1}, None)
    nothing = RecoveryResult(dry_run=False, recovery_id="recover-2", voided=0, requeued=0, after=after,
                             voided_at=when)
    assert nothing.backup_path is None and nothing.backup_sha256 is None  # an empty plan writes no backup


@pytest.mark.parametrize("fields", [
    {"dry_run": True, "void": [], "requeue": []},  # a dry run lists all three
    {"dry_run": True, "void": [], "requeue": [], "kept": [], "voided": 0},
    {"dry_run": True, "void": [], "requeue": [], "kept": [], "backup_sha256": "a" * 64},
    {"dry_run": False, "recovery_id": "r", "voided": 0, "requeued": 0, "voided_at": "2026-12-01T00:00:00Z"},  # no after
    {"dry_run": False, "recovery_id": "r", "voided": 0, "requeued": 0,  # no voided_at
     "after": {"trials": 0, "void_trials": 0, "tasks_by_status": {}}},
    {"dry_run": True, "void": [], "requeue": [], "kept": [], "voided_at": "2026-12-01T00:00:00Z"},
    {"dry_run": False, "recovery_id": "r", "voided": 0, "requeued": 0, "void": [],
     "after": {"trials": 0, "void_trials": 0, "tasks_by_status": {}}},
    {"dry_run": False, "recovery_id": "r", "voided": -1, "requeued": 0,
     "after": {"trials": 0, "void_trials": 0, "tasks_by_status": {}}},
])
def test_recover_result_refuses_a_mix_of_dry_run_and_applied(fields):
    with pytest.raises(ValidationError):
        RecoveryResult.model_validate(fields)
