"""What the canary flows return (forgeflow.evaluation.canary_result): typed reports, the keys users
read, and the refusal of a recovery result that is half there."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from forgeflow.evaluation.canary_result import (
    CanaryRecoveryResult,
    CanaryResult,
    CanaryTrialOutcome,
    MergedView,
)
from forgeflow.evaluation.compare import JobReport


def _report(*outcomes: tuple[float | None, str | None]) -> JobReport:
    return JobReport.from_trials([SimpleNamespace(instance_id=f"i{n}", reward=r, exception_type=e)
                                  for n, (r, e) in enumerate(outcomes)])


def test_canary_result_dumps_the_keys_the_flow_returned_as_a_dict():
    report = _report((1.0, None), (None, "ModelEndpointError"))
    result = CanaryResult(job_id="canary-x", report=report, report_path=Path("/c/canary-x/report.md"),
                          trials=[CanaryTrialOutcome(instance_id="i0", reward=1.0),
                                  CanaryTrialOutcome(instance_id="i1", exception_type="ModelEndpointError")])
    dumped = json.loads(result.model_dump_json())
    exclusions = dumped.pop("exclusions")  # added beside the keys the flow returned: its exclusions with the rate
    assert dumped == {"job_id": "canary-x", "report": report.model_dump(mode="json"),
                      "report_path": "/c/canary-x/report.md",
                      "trials": [{"instance_id": "i0", "reward": 1.0, "exception_type": None},
                                 {"instance_id": "i1", "reward": None, "exception_type": "ModelEndpointError"}]}
    assert exclusions["by_type"] == [{"exception_type": "ModelEndpointError", "count": 1, "rate": 0.5}]
    assert exclusions["unusable"] and "job canary-x is unusable: 1 of 2 trials (50.0%)" in exclusions["reason"]
    dumped["exclusions"] = exclusions
    assert CanaryResult.model_validate(dumped) == result  # the JSON reads back into the same result
    assert result.report.exceptions == 1


def test_recovery_result_with_and_without_a_recovery_job():
    merged = MergedView(view="original job j + 1 recovery job (j-r)", recovery_job_ids=["j-r"],
                        report=_report((1.0, None), (0.0, None)))
    ran = CanaryRecoveryResult(job_id="j-r", parent_job_id="j", report=_report((0.0, None)),
                               report_path=Path("/c/j-r/report.md"), merged=merged,
                               recovered=[CanaryTrialOutcome(instance_id="i1", original_trial_id="t-1",
                                                             trial_id="t-2", reward=0.0)])
    assert ran.model_dump_json().split('"recovered":')[1].startswith(  # the keys in the order the flow wrote them
        '[{"instance_id":"i1","original_trial_id":"t-1","trial_id":"t-2","reward":0.0,"exception_type":null}]')
    with pytest.raises(ValidationError, match="trial_id and original_trial_id"):  # a recovered trial names both
        CanaryRecoveryResult.model_validate({**ran.model_dump(), "recovered": [{"instance_id": "i1", "reward": 0.0}]})
    nothing = CanaryRecoveryResult(parent_job_id="j", merged=merged)
    assert (nothing.job_id, nothing.recovered, nothing.report, nothing.report_path) == (None, [], None, None)


@pytest.mark.parametrize("fields", [
    {"job_id": "j-r"},  # a recovery job without its report
    {"job_id": "j-r", "report_path": "/c/j-r/report.md"},
    {"job_id": None, "report_path": "/c/report.md"},  # no job, yet a report file
    {"job_id": None, "recovered": [{"instance_id": "i", "original_trial_id": "a", "trial_id": "b"}]},
])
def test_recovery_result_refuses_a_half_recovery(fields):
    merged = {"view": "job j", "recovery_job_ids": [], "report": _report((1.0, None)).model_dump(mode="json")}
    with pytest.raises(ValidationError):
        CanaryRecoveryResult.model_validate({"parent_job_id": "j", "merged": merged, **fields})
