"""What a re-score returns and the report a person reads (:mod:`forgeflow.evaluation.rescore` does the work)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.evaluation.compare import JobExclusions, JobReport, exclusion_lines, job_exclusions
from forgeflow.evaluation.rescore import RescorePlan, VerdictChange


class RescoreResult(BaseModel):
    """One re-score, as the ``rescore`` flow returns it.

    Attributes:
        job_id: the new job (kind ``rescore``; compare and the promotion gate take it by this id).
        parent_job_id: the job re-scored (its rows are never rewritten).
        view: the view re-scored (``job X`` or ``original job X + N recovery jobs``).
        verifier_sha256: the verifier source digest it ran under.
        counts: ``trials``, ``reverify``, ``carried``, ``missing`` and ``changed`` (verdicts that differ).
        report: the new job's accounting.
        original_report: the original view's accounting.
        exclusions: the new job's trials excluded as exceptions, per type with the rate (default limit).
        changes: the verdict table, one row per task in instance-id order.
        report_path: the markdown report (``<out_dir>/<job_id>/report.md``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    job_id: str = Field(min_length=1, description="The new job (kind rescore).")
    parent_job_id: str = Field(min_length=1, description="The job re-scored.")
    view: str = Field(description="The view re-scored (the original and its recovery jobs).")
    verifier_sha256: str = Field(description="The verifier source digest it ran under.")
    counts: dict[str, int] = Field(description="trials, reverify, carried, missing, changed.")
    report: JobReport = Field(description="The new job's accounting.")
    original_report: JobReport = Field(description="The original view's accounting.")
    exclusions: JobExclusions = Field(description="The new job's exclusions per exception type, with the rate.")
    changes: list[VerdictChange] = Field(description="The verdict table, one row per task.")
    report_path: Path = Field(description="The markdown report.")

    @property
    def changed(self) -> list[VerdictChange]:
        """The rows whose verdict changed."""
        return [c for c in self.changes if c.changed]


def _outcome(reward: float | None, exception: str | None) -> str:
    """``reward 1``, ``reward 0``, ``ModelEndpointError`` or ``AgentTimeoutError, reward 1`` (flagged)."""
    parts = [exception] if exception else []
    if reward is not None:
        parts.append(f"reward {reward:g}")
    return ", ".join(parts) or "-"


def change_rows(changes: Sequence[VerdictChange]) -> list[dict[str, object]]:
    """The verdict table as rows for a table artifact: instance, old and new outcome, changed, action, why."""
    return [{"instance_id": c.instance_id, "old": _outcome(c.old_reward, c.old_exception),
             "new": _outcome(c.new_reward, c.new_exception), "changed": c.changed,
             "action": c.action + (f" ({c.source})" if c.source else ""), "why": c.why} for c in changes]


def _accounting(report: JobReport) -> str:
    w = report.wilson
    return (f"{report.requested} | {report.scored} | {report.exceptions} | {report.reward_1} | {report.reward_0} | "
            f"{report.pass_rate_scored:.1%} | [{w.low:.1%}, {w.high:.1%}]")


def render_rescore_report(plan: RescorePlan, report: JobReport, original_report: JobReport,
                          changes: Sequence[VerdictChange]) -> str:
    """The markdown report of a re-score: the jobs, the verifier digest and settings, both accountings, the
    changed verdicts first, every task's old and new verdict with the reason, and each job's exclusions."""
    counts = plan.counts()
    changed = [c for c in changes if c.changed]
    c = plan.agent_config
    lines = [f"# Re-score `{plan.rescore_job_id}` of `{plan.original.job_id}`", "",
             f"- view re-scored: {plan.merged_label} (its rows are unchanged)",
             f"- freeze `{plan.original.freeze_name}`, split `{plan.original.split}`, model "
             f"`{plan.original.model_sha256}`",
             f"- verifier source sha256 `{plan.verifier_sha256}`; timeout {plan.verifier_timeout_s:g} s, "
             f"{c.memory_mb} MiB, {c.cpus:g} CPUs, tamper policy {c.tamper_policy}",
             f"- {counts['trials']} tasks: {counts['reverify']} re-verified, {counts['carried']} carried over (no "
             f"submission was made), {counts['missing']} with the submission missing; {len(changed)} verdicts changed",
             "", "| job | requested | scored | exceptions | reward 1 | reward 0 | pass rate (scored) | Wilson 95% |",
             "|---|---|---|---|---|---|---|---|",
             f"| original `{plan.original.job_id}` | {_accounting(original_report)} |",
             f"| re-score `{plan.rescore_job_id}` | {_accounting(report)} |", ""]
    table = ["| instance_id | original | now | changed | how | why |", "|---|---|---|---|---|---|"]
    for row in change_rows(sorted(changes, key=lambda c: (not c.changed, c.instance_id))):
        why = str(row["why"]).replace("|", "\\|").replace("\n", " ")
        table.append(f"| {row['instance_id']} | {row['old']} | {row['new']} | {'yes' if row['changed'] else ''} "
                     f"| {row['action']} | {why} |")
    lines += [f"## Verdicts ({len(changed)} changed, listed first)", "", *table, ""]
    for title, job_id, job_report in (("re-score", plan.rescore_job_id, report),
                                      ("original", plan.original.job_id, original_report)):
        lines += [f"## Exclusions of the {title} `{job_id}`", "", *exclusion_lines(job_exclusions(job_report, job_id)),
                  ""]
    return "\n".join(lines)
