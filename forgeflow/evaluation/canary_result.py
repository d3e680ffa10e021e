"""What the ``canary`` and ``canary-recover`` flows return (``flows/canary.py``): frozen pydantic
models whose field names are the keys those flows returned as dicts before, so the data a user reads
is unchanged; the job reports are :class:`forgeflow.evaluation.compare.JobReport` itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from forgeflow.evaluation.compare import JobExclusions, JobReport, MergedJob, job_exclusions


def _with_exclusions(data: Any, job_field: str | None = None, label_field: str | None = None) -> Any:
    """``data`` (a result's fields) with ``exclusions`` counted from its ``report`` when not given (the flows
    build their results without it; the default limit applies, ``forgeflow compare`` takes another); the
    job named by ``data[job_field]`` or labelled ``data[label_field]``."""
    if not isinstance(data, dict) or data.get("exclusions") is not None or data.get("report") is None:
        return data
    report = JobReport.model_validate(data["report"])
    return {**data, "exclusions": job_exclusions(report, data.get(job_field) if job_field else None,
                                                 label=data.get(label_field) if label_field else None)}


def _unset(value: str | None) -> bool:
    return value is None


class CanaryTrialOutcome(BaseModel):
    """One agent trial as the canary flows report it: a canary job's (:attr:`CanaryResult.trials`), or a
    recovery job's trial with the original job's exception trial it re-ran
    (:attr:`CanaryRecoveryResult.recovered`: both trial ids set). An id not set is not dumped."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    instance_id: str = Field(min_length=1, description="The task.")
    original_trial_id: str | None = Field(default=None, min_length=1, exclude_if=_unset,
                                          description="Recovered: the original job's exception trial.")
    trial_id: str | None = Field(default=None, min_length=1, exclude_if=_unset,
                                 description="Recovered: the recovery job's trial of the task.")
    reward: float | None = Field(default=None, description="The verifier's reward; None after an exception.")
    exception_type: str | None = Field(default=None, description="The exception's class name; None when scored.")


class CanaryResult(BaseModel):
    """One canary job, as the ``canary`` flow returns it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    job_id: str = Field(min_length=1, description="The job's id.")
    report: JobReport = Field(description="The job's outcome counts, pass rates and Wilson interval.")
    report_path: Path = Field(description="The markdown job report (<out_dir>/<job_id>/report.md).")
    trials: list[CanaryTrialOutcome] = Field(description="The job's trials, in report order.")
    exclusions: JobExclusions = Field(description="Trials excluded as exceptions, per type with the rate; "
                                      "unusable above the limit.")

    @model_validator(mode="before")
    @classmethod
    def _count_exclusions(cls, data: Any) -> Any:
        return _with_exclusions(data, "job_id")


class MergedView(BaseModel):
    """A canary job merged with its recovery jobs (:func:`forgeflow.evaluation.compare.merged_job`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    view: str = Field(min_length=1, description="The merged view's label.")
    recovery_job_ids: list[str] = Field(description="The recovery jobs, oldest first.")
    report: JobReport = Field(description="The merged trials' report.")
    exclusions: JobExclusions = Field(description="Trials the merged view excludes as exceptions, per type with "
                                      "the rate; unusable above the limit.")

    @model_validator(mode="before")
    @classmethod
    def _count_exclusions(cls, data: Any) -> Any:
        return _with_exclusions(data, label_field="view")

    @classmethod
    def of(cls, merged: MergedJob) -> MergedView:
        """The view of ``merged`` (:func:`forgeflow.evaluation.compare.merged_job`'s): its label, recovery jobs
        and the report of its standing trials."""
        return cls(view=merged.label, recovery_job_ids=list(merged.recovery_job_ids),
                   report=JobReport.from_trials(merged.trials))


class CanaryRecoveryResult(BaseModel):
    """One ``canary-recover`` run: the recovery job it ran, or None when nothing was left to recover."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    job_id: str | None = Field(default=None, description="The recovery job; None: nothing to recover.")
    parent_job_id: str = Field(min_length=1, description="The original canary job.")
    recovered: list[CanaryTrialOutcome] = Field(default_factory=list, description="Each re-run exception "
                                                "trial and its new outcome (both trial ids set).")
    report: JobReport | None = Field(default=None, description="The recovery job's report; None: nothing re-run.")
    report_path: Path | None = Field(default=None, description="The recovery job's markdown report.")
    merged: MergedView = Field(description="The original job merged with its recovery jobs.")

    @model_validator(mode="after")
    def _ran_or_not(self) -> CanaryRecoveryResult:
        """A recovery job has its report and report file; no job has neither and recovered nothing; each
        recovered trial names its trial and the original's."""
        ran = (self.report is not None, self.report_path is not None)
        unnamed = [t.instance_id for t in self.recovered if t.trial_id is None or t.original_trial_id is None]
        if unnamed:
            raise ValueError(f"recovered trials of {unnamed} need their trial_id and original_trial_id")
        if self.job_id is not None and not all(ran):
            raise ValueError(f"recovery job {self.job_id!r} needs its report and report_path")
        if self.job_id is None and (any(ran) or self.recovered):
            raise ValueError("a result without a recovery job has no report, report_path or recovered trials")
        return self
