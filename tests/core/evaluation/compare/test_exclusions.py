"""Exclusion counts per exception type with the rate, and the limit above which a job is unusable: what the
canary's result, ``forgeflow compare`` and the promotion gate show (no Prefect, no podman)."""

from __future__ import annotations

from pathlib import Path

import pytest

from forgeflow.common.errors import InputError
from forgeflow.evaluation.canary_result import CanaryResult, CanaryTrialOutcome
from forgeflow.evaluation.compare import JobReport, compare_stored_jobs, job_exclusions
from forgeflow.evaluation.compare.gate import GatePolicy
from forgeflow.ledger.records import JobRecord, TaskRecord, TrialRecord
from forgeflow.ledger.store import Store


class _T:
    def __init__(self, instance_id: str, reward: float | None, exception_type: str | None = None) -> None:
        self.instance_id, self.reward, self.exception_type = instance_id, reward, exception_type


def test_exclusions_count_each_exception_type_with_its_rate_and_the_missing_trials() -> None:
    trials = [_T("a", 1.0), _T("b", 0.0), _T("c", None, "ModelEndpointError"), _T("d", None, "ModelEndpointError"),
              _T("e", None, "SandboxOOMError"), _T("f", 1.0, "AgentTimeoutError")]  # f: flagged, reward kept
    ex = job_exclusions(JobReport.from_trials(trials, requested=8), "job-1")
    assert [(c.exception_type, c.count, c.rate) for c in ex.by_type] == [
        ("ModelEndpointError", 2, 0.25), ("missing (no trial recorded)", 2, 0.25), ("AgentTimeoutError", 1, 0.125),
        ("SandboxOOMError", 1, 0.125)]
    assert (ex.requested, ex.excluded, ex.exception_rate) == (8, 6, 0.75)
    assert ex.unusable and ex.reason.startswith("job job-1 is unusable: 6 of 8 trials (75.0%): ModelEndpointError 2 "
                                                "(25.0%)")
    assert "above the limit 20.0% (max_exception_rate 0.2)" in ex.reason


def test_a_job_is_unusable_only_strictly_above_the_limit() -> None:
    five = [_T(f"t{i}", 1.0) for i in range(4)] + [_T("t4", None, "SandboxOOMError")]  # 1 of 5 = 20%
    report = JobReport.from_trials(five)
    assert not job_exclusions(report, "j").unusable  # 20% is not above 20%
    assert job_exclusions(report, "j", 0.19).unusable
    clean = job_exclusions(JobReport.from_trials(five[:4]), "j", 0.0)
    assert not clean.unusable and clean.describe() == "none of 4 trials" and clean.by_type == []
    with pytest.raises(ValueError):
        job_exclusions(report, "j", 1.5)
    with pytest.raises(InputError, match="max_exception_rate"):
        GatePolicy.build(max_exception_rate=-0.1)


def test_the_canary_result_carries_its_exclusions() -> None:
    trials = [_T("a", 1.0), _T("b", None, "VerifierTimeoutError"), _T("c", None, "VerifierTimeoutError")]
    result = CanaryResult(job_id="canary-x", report=JobReport.from_trials(trials), report_path=Path("r.md"),
                          trials=[CanaryTrialOutcome(instance_id=t.instance_id, reward=t.reward,
                                                     exception_type=t.exception_type) for t in trials])
    assert result.exclusions.unusable and result.exclusions.excluded == 2
    assert result.exclusions.by_type[0].model_dump() == {"exception_type": "VerifierTimeoutError", "count": 2,
                                                         "rate": pytest.approx(2 / 3)}
    assert CanaryResult.model_validate(result.model_dump()) == result  # round-trips with the counts


def test_compare_marks_an_unusable_job_and_the_gate_holds(tmp_path: Path) -> None:
    """Thirty pairs from three repositories where B never loses promote under a drop allowance of 100 points;
    with a quarter of B's trials lost to the sandbox, B is unusable: named with its rate and the limit, and the
    gate holds."""
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    store.upgrade()
    ids = [f"r{i % 3}.t{i}" for i in range(40)]
    for job in ("a", "b"):
        store.record_job(JobRecord(job_id=job, kind="canary", freeze_name="f", split="test"))
    for n, instance_id in enumerate(ids):
        store.record_task(TaskRecord(instance_id=instance_id, repo=instance_id.split(".")[0], status="accepted"))
        store.record_trial(TrialRecord(trial_id=f"a-{n}", instance_id=instance_id, kind="agent", job_id="a",
                                       reward=1.0))
        lost = n >= 30  # 10 of 40 = 25%
        store.record_trial(TrialRecord(trial_id=f"b-{n}", instance_id=instance_id, kind="agent", job_id="b",
                                       reward=None if lost else 1.0,
                                       exception_type="SandboxOOMError" if lost else None,
                                       exception_message="oom" if lost else None))
    result = compare_stored_jobs(store, "a", "b", gate=GatePolicy(max_drop=1.0))
    assert result.paired.n_pairs == 30 and result.exclusions_b.unusable and not result.exclusions_a.unusable
    assert result.decision.verdict == "hold" and result.decision.unusable == [result.exclusions_b.reason]
    assert result.decision.reason.startswith("not compared: job b is unusable: 10 of 40 trials (25.0%): "
                                             "SandboxOOMError 10 (25.0%) excluded as exceptions, above the limit 20.0%")
    assert "the pairs alone: promote" in result.decision.reason
    assert result.markdown.startswith("## b vs a\n\n- **not compared: job b is unusable")
    assert "| SandboxOOMError | 10 | 25.0% |" in result.markdown
    assert result.to_json()["exclusions"]["b"]["exception_rate"] == 0.25
    lenient = compare_stored_jobs(store, "a", "b", gate=GatePolicy(max_drop=1.0, max_exception_rate=0.25))
    assert lenient.decision.verdict == "promote" and lenient.decision.unusable == []
