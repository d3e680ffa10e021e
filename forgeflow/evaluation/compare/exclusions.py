"""What a job's numbers leave out: the trials excluded as exceptions (or missing), per type, with the rate,
and whether the job is unusable for a comparison (:func:`job_exclusions`).

The default limit, :data:`DEFAULT_MAX_EXCEPTION_RATE` = 0.2, follows the rule Marin adopted for agentic
evaluations run through Harbor (marin-community/marin issue #8084,
https://github.com/marin-community/marin/issues/8084; Marin's gate is 90% on batches of hundreds). A canary
runs tens, so the limit is set by the binomial tail at the gate's 30 pairs: a sandbox failing 5% of trials
marks a 30-trial job unusable with probability 0.06% at 0.2 (6.1% at 0.1); one failing 30% is caught with
probability 84% (98% at 40%). A policy number: :class:`~forgeflow.evaluation.compare.gate.GatePolicy`
``max_exception_rate`` changes it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.evaluation.compare.stats import JobReport

DEFAULT_MAX_EXCEPTION_RATE = 0.2
"""Largest fraction of a job's requested trials that may be excluded (exceptions and missing trials) before
the job is unusable for a comparison (see the module docstring for the source and the reasoning)."""

MISSING = "missing (no trial recorded)"
"""The exclusion type of a requested trial that produced no record at all."""


class ExclusionCount(BaseModel):
    """One exclusion type of a job."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    exception_type: str = Field(min_length=1, description="The exception's class name, or 'missing'.")
    count: int = Field(ge=1, description="Trials excluded for it.")
    rate: float = Field(ge=0.0, le=1.0, description="count / requested trials (fraction).")


class JobExclusions(BaseModel):
    """The trials a job's numbers leave out, and whether the job can be compared."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    job_id: str | None = Field(default=None, description="The job (None: not a stored job's report).")
    requested: int = Field(ge=0, description="Trials the job asked for.")
    by_type: list[ExclusionCount] = Field(default_factory=list, description="Each exclusion type, largest first.")
    excluded: int = Field(ge=0, description="Excluded trials (exceptions and missing).")
    exception_rate: float = Field(ge=0.0, le=1.0, description="excluded / requested (fraction).")
    max_exception_rate: float = Field(ge=0.0, le=1.0, description="The limit (fraction of requested trials).")
    unusable: bool = Field(description="exception_rate > max_exception_rate.")
    reason: str | None = Field(default=None, description="Why it is unusable (job, rate, limit); None: usable.")

    def describe(self) -> str:
        """``3 of 10 trials (30.0%): ModelEndpointError 2 (20.0%), SandboxOOMError 1 (10.0%)`` or ``none of 10``."""
        if not self.excluded:
            return f"none of {self.requested} trials"
        types = ", ".join(f"{c.exception_type} {c.count} ({c.rate:.1%})" for c in self.by_type)
        return f"{self.excluded} of {self.requested} trials ({self.exception_rate:.1%}): {types}"


def job_exclusions(report: JobReport, job_id: str | None = None, max_exception_rate: float = DEFAULT_MAX_EXCEPTION_RATE,
                   *, label: str | None = None) -> JobExclusions:
    """Count what ``report`` (one job's :class:`~forgeflow.evaluation.compare.stats.JobReport`) leaves out;
    ``unusable`` when the excluded fraction is strictly above the limit.

    Raises:
        ValueError: ``max_exception_rate`` outside [0, 1] (pydantic's ValidationError).
    """
    requested = report.requested
    counts = dict(report.exceptions_by_type)
    if report.missing:
        counts[MISSING] = report.missing
    by_type = [ExclusionCount(exception_type=name, count=n, rate=n / requested if requested else 0.0)
               for name, n in sorted(counts.items(), key=lambda item: (-item[1], item[0]))]
    excluded = sum(counts.values())
    rate = excluded / requested if requested else 0.0
    unusable = rate > max_exception_rate
    out = JobExclusions(job_id=job_id, requested=requested, by_type=by_type, excluded=excluded, exception_rate=rate,
                        max_exception_rate=max_exception_rate, unusable=unusable)
    if unusable:
        name = label or (f"job {job_id}" if job_id else "the job")
        reason = (f"{name} is unusable: {out.describe()} excluded as exceptions, above the limit "
                  f"{max_exception_rate:.1%} (max_exception_rate {max_exception_rate:g})")
        out = out.model_copy(update={"reason": reason})
    return out


def exclusion_lines(exclusions: JobExclusions) -> list[str]:
    """Markdown lines a job report shows: one line with the total and the rate, then a table of the
    exclusion types (count, rate) when there is any, and the unusable mark when the job is."""
    head = (f"Excluded from the pass rates: {exclusions.excluded} of {exclusions.requested} trials "
            f"({exclusions.exception_rate:.1%}; a job above {exclusions.max_exception_rate:.1%} is unusable "
            f"for a comparison).")
    lines = [head]
    if exclusions.by_type:
        lines += ["", "| excluded as | trials | rate |", "|---|---:|---:|"]
        lines += [f"| {c.exception_type} | {c.count} | {c.rate:.1%} |" for c in exclusions.by_type]
    if exclusions.unusable:
        lines += ["", f"**Unusable: {exclusions.reason}.**"]
    return lines
