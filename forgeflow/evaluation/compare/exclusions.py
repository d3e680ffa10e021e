"""What a job's numbers leave out: the trials excluded as exceptions, per exception type, with the rate, and
whether so many were excluded that the job is unusable for a comparison (:func:`job_exclusions`).

A trial that ended in an exception (an infrastructure failure, or an agent run the harness cut short) has
no reward the pass rates can use, and a trial that never came back (``missing``) has none either: both
leave the job's pass rates and the paired comparison. Leaving them out is right for one trial and wrong
for many: what was not measured can move a pass rate by up to the excluded fraction in either direction,
and a job whose sandbox broke on a quarter of its trials measures the sandbox as much as the model. So
every report says how many trials each exception type took, as a count and as a rate of the requested
trials, and a job whose excluded fraction is above ``max_exception_rate`` is *unusable*: the comparison
names it (job, rate, limit) and the promotion gate holds (:func:`forgeflow.evaluation.compare.gate.promotion_decision`).

The default limit, :data:`DEFAULT_MAX_EXCEPTION_RATE` = 0.2 (at most a fifth of a job's trials excluded),
follows the rule Marin adopted for agentic evaluations run through Harbor (marin-community/marin issue
#8084, https://github.com/marin-community/marin/issues/8084): a run is accepted when enough of its trials
executed, with its per-type error counts kept beside the score, and failed below that. Marin's gate is 90%
on batches of hundreds of trials; a canary runs tens, where the observed rate is noisy, so the limit is
set by the binomial tail at the promotion gate's 30 pairs: a sandbox that fails 5% of trials (healthy)
marks a 30-trial job unusable with probability 0.06% at 0.2 (6.1% at 0.1), while one that fails 30% of
trials is caught with probability 84% (98% at 40%). The unmeasured fifth can still move a pass rate by
more than the gate's tolerated drop: the paired interval and the gate's minimum pairs carry that, and a
team that wants Marin's 90% passes 0.1. It is a policy number: the ``compare`` command and flow, the
``promote`` flow and the lifecycle take another through :class:`~forgeflow.evaluation.compare.gate.GatePolicy`
(``max_exception_rate``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.evaluation.compare.stats import JobReport

DEFAULT_MAX_EXCEPTION_RATE = 0.2
"""Largest fraction of a job's requested trials that may be excluded (exceptions and missing trials) before
the job is unusable for a comparison (see the module docstring for the source and the reasoning)."""

MISSING = "missing (no trial recorded)"
"""The exclusion type of a requested trial that produced no record at all."""


class ExclusionCount(BaseModel):
    """One exclusion type of a job.

    Attributes:
        exception_type: the exception's class name (``ModelEndpointError``...), or :data:`MISSING`.
        count: trials excluded for it.
        rate: ``count / requested``, a fraction in [0, 1].
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    exception_type: str = Field(min_length=1, description="The exception's class name, or 'missing'.")
    count: int = Field(ge=1, description="Trials excluded for it.")
    rate: float = Field(ge=0.0, le=1.0, description="count / requested trials (fraction).")


class JobExclusions(BaseModel):
    """The trials a job's numbers leave out, and whether the job can be compared.

    Attributes:
        job_id: the job (None when the report is not a stored job's).
        requested: trials the job asked for.
        by_type: each exclusion type with its count and rate, the largest first (then by name); flagged
            trials (an agent timeout that kept the verifier's reward) count under their exception type.
        excluded: all excluded trials (every exception plus every missing trial).
        exception_rate: ``excluded / requested``, a fraction in [0, 1] (0 for a job that requested nothing).
        max_exception_rate: the limit it was held to (fraction).
        unusable: ``exception_rate > max_exception_rate``.
        reason: why it is unusable, naming the job, the rate and the limit (None when usable).
    """

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
    """Count what ``report`` (one job's :class:`~forgeflow.evaluation.compare.stats.JobReport`) leaves out.

    Args:
        report: the job's report (its ``exceptions_by_type``, ``missing`` and ``requested``).
        job_id: the job, named in the reason.
        max_exception_rate: largest excluded fraction of the requested trials for a usable job, in [0, 1].
        label: how the reason names the job (default ``job <job_id>``; a merged view passes its label).

    Returns:
        :class:`JobExclusions`; ``unusable`` when the excluded fraction is strictly above the limit.

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
