"""The re-score's plan on a real SQLite store and trajectory files (no sandbox): where each submission comes from,
what is carried over or missing (never scored 0), the new job's rows, and a re-score job that compare takes by
its id but a merged view never takes in as a recovery job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy import text

from forgeflow.common.errors import InputError
from forgeflow.evaluation import compare
from forgeflow.evaluation.agent_config import AgentConfig
from forgeflow.evaluation.rescore import (
    RescoreItem,
    VerdictChange,
    check_rescorable,
    plan_item,
    rescore_trial,
)
from forgeflow.ledger.records import JobRecord, TrialRecord
from forgeflow.ledger.store import Store

DIFF = "diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n@@ -1 +1 @@\n-a - b\n+a + b\n"
CONFIG = AgentConfig(memory_mb=256, cpus=1, tamper_policy="reject")


def _trajectory(folder: Path, trial_id: str, submission: str | None, error: str | None = None) -> None:
    info = {"exit_status": "Submitted", "forgeflow": {"error": error}}
    if submission is not None:
        info["submission"] = submission
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{trial_id}.traj.json").write_text(json.dumps({"info": info, "messages": []}))


@pytest.fixture
def store(tmp_path: Path) -> Store:
    """A canary job ``c`` of eight trials, each a case of where its submission is (see the test)."""
    s = Store(f"sqlite:///{tmp_path / 'store.db'}")
    s.upgrade()
    folder = tmp_path / "c" / "trajectories"
    s.record_job(JobRecord(job_id="c", kind="canary", freeze_name="f", split="test", model_sha256="a" * 64,
                           params={"trajectories_dir": str(folder)}))

    def trial(n: str, reward: float | None, exc: str | None = None, **extra) -> None:
        s.record_trial(TrialRecord(trial_id=f"c-{n}", instance_id=f"calc.{n}", kind="agent", job_id="c",
                                   reward=reward, exception_type=exc, exception_message=exc and "broke",
                                   agent_steps=3, input_tokens=100, timings={"agent_s": 5.0, "verifier_s": 1.0},
                                   **extra))

    trial("t1", 1.0, submission=DIFF)                    # kept in the store
    trial("t2", 0.0)                                     # an older trial: its trajectory holds the diff
    _trajectory(folder, "c-t2", "")
    trial("t3", None, "ModelEndpointError")              # the agent never made a submission
    _trajectory(folder, "c-t3", "", "ModelEndpointError: connection refused")
    trial("t4", 0.0)                                     # scored, but its trajectory is gone
    trial("t5", None, "VerifierTimeoutError")            # the verifier broke on a submission that exists
    _trajectory(folder, "c-t5", DIFF)
    trial("t6", 1.0, submission=DIFF)                    # its stored diff no longer matches its digest
    with s.engine.begin() as connection:
        connection.execute(text("UPDATE trials SET submission = 'tampered' WHERE trial_id = 'c-t6'"))
    trial("t7", 1.0, "AgentTimeoutError")                # flagged: the agent overran, the verifier ran
    _trajectory(folder, "c-t7", DIFF, "AgentTimeoutError: 600 s")
    trial("t8", None, "SandboxOOMError")                 # the verifier broke before its git wrote the submission
    _trajectory(folder, "c-t8", "")
    return s


def test_each_submission_comes_from_the_store_else_its_trajectory_and_a_lost_one_is_named(store: Store) -> None:
    dirs: dict = {}
    items = {t.instance_id: plan_item(store, t, dirs) for t in store.trials_for(job_id="c")}
    how = {i: (item.action, item.source) for i, item in items.items()}
    assert how == {"calc.t1": ("reverify", "store"), "calc.t2": ("reverify", "trajectory"),
                   "calc.t3": ("carried", None), "calc.t4": ("missing", None), "calc.t5": ("reverify", "trajectory"),
                   "calc.t6": ("missing", None), "calc.t7": ("reverify", "trajectory"), "calc.t8": ("missing", None)}
    assert items["calc.t1"].submission == DIFF and items["calc.t2"].submission == ""
    assert "ended in ModelEndpointError before it made a submission" in items["calc.t3"].reason
    assert "no trajectory at" in items["calc.t4"].reason and "c-t4.traj.json" in items["calc.t4"].reason
    assert "is not the recorded" in items["calc.t6"].reason
    assert "the trajectory's submission is empty and the original was never scored" in items["calc.t8"].reason


def test_carried_and_missing_trials_are_exceptions_of_the_new_job_never_reward_0(store: Store) -> None:
    dirs: dict = {}
    items = {t.instance_id: plan_item(store, t, dirs) for t in store.trials_for(job_id="c")}
    out = {i: rescore_trial(items[i], CONFIG, 60, "c-rescore-x") for i in ("calc.t3", "calc.t4", "calc.t6")}
    assert {i: (row.reward, row.exception_type) for i, row in out.items()} == {
        "calc.t3": (None, "ModelEndpointError"), "calc.t4": (None, "SubmissionMissingError"),
        "calc.t6": (None, "SubmissionMissingError")}
    changes = {i: VerdictChange.of(items[i], row) for i, row in out.items()}
    assert [i for i, c in changes.items() if c.changed] == ["calc.t4", "calc.t6"]
    assert changes["calc.t4"].why.startswith("submission missing: no submission in the store, no trajectory at")
    assert (changes["calc.t3"].original_trial_id, changes["calc.t3"].trial_id) == ("c-t3", out["calc.t3"].trial_id)
    assert out["calc.t3"].verifier["rescore_of"] == "c-t3" and out["calc.t3"].agent_steps == 3
    assert "verifier_s" not in out["calc.t3"].timings and out["calc.t3"].timings["agent_s"] == 5.0


def test_a_rescore_job_is_compared_by_its_id_and_never_merged_as_a_recovery(store: Store) -> None:
    store.record_job(JobRecord(job_id="c-rescore-x", kind="rescore", parent_job_id="c", freeze_name="f", split="test",
                               model_sha256="a" * 64))
    for t in store.trials_for(job_id="c"):  # the same verdicts, new rows (the originals' submissions kept)
        store.record_trial(t.model_copy(update={"trial_id": f"r-{t.trial_id}", "job_id": "c-rescore-x",
                                                "submission": None, "submission_sha256": None}))
    view = compare.merged_job(store, "c")
    assert view.recovery_job_ids == [] and view.label == "job c"
    assert {t.job_id for t in view.trials} == {"c"}
    result = compare.compare_stored_jobs(store, "c", "c-rescore-x")
    assert result.split_checked.startswith("freeze f, split test") and (result.paired.wins, result.paired.losses) == (0, 0)
    assert store.trials_for(trial_ids=["c-t1"])[0].submission == DIFF  # the original's row is as it was


def test_the_job_to_rescore_is_checked_with_the_jobs_there_are(store: Store) -> None:
    store.record_job(JobRecord(job_id="c-r1", kind="recovery", parent_job_id="c"))
    with pytest.raises(InputError, match=r"job 'cc' is not recorded in the store .*its canary and rescore jobs: c$"):
        check_rescorable(store, "cc")
    with pytest.raises(InputError, match="is a recovery job of 'c': give the original job"):
        check_rescorable(store, "c-r1")
    assert check_rescorable(store, "c").kind == "canary"


def test_a_trial_keeps_its_submission_with_a_digest_and_a_resumed_record_does_not_lose_it(store: Store) -> None:
    row = store.trials_for(trial_ids=["c-t1"])[0]
    assert row.submission_sha256 is not None and len(row.submission_sha256) == 64
    store.record_trial(row.model_copy(update={"submission": None, "submission_sha256": None}))
    assert store.trials_for(trial_ids=["c-t1"])[0].submission == DIFF
    with pytest.raises(ValueError, match="is not the sha256 of its submission"):
        TrialRecord(trial_id="x", instance_id="i", kind="agent", reward=0.0, submission="a", submission_sha256="0" * 64)
    assert RescoreItem(original=row, action="reverify", submission=DIFF, source="store").tests is None
