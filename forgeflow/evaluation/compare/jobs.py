"""Comparisons of jobs recorded in the store: a canary job merged with its recovery jobs
(:func:`merged_job`), the check that two jobs ran the same frozen split
(:func:`refuse_unless_same_split`), excluded tasks with reasons, and the whole stored-jobs
comparison the ``compare`` flow and CLI run (:func:`compare_stored_jobs`), with the settings a
flow passes it as one parameter group (:class:`ComparisonSettings`)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common.errors import InputError
from forgeflow.evaluation.compare.exclusions import JobExclusions, exclusion_lines, job_exclusions
from forgeflow.evaluation.compare.gate import (
    Decision,
    GatePolicy,
    promotion_decision,
)
from forgeflow.evaluation.compare.report import render_markdown
from forgeflow.evaluation.compare.stats import (
    CostComparison,
    JobReport,
    PairedComparison,
    cost_ratios,
    paired_compare,
    rewards_by_instance,
)


# --- same split -------------------------------------------------------------------------------
def refuse_unless_same_split(
    instances_a: Iterable[str],
    instances_b: Iterable[str],
    freeze_digest_a: str | None = None,
    freeze_digest_b: str | None = None,
    label_a: str = "A",
    label_b: str = "B",
) -> list[str]:
    """Refuse to compare two runs that did not run the same frozen split; returns the shared ids, sorted.

    Raises:
        InputError: the freeze digests differ, only one run names one, or the instance sets differ (the
            digests or the first differing ids and counts named).
    """
    if (freeze_digest_a is None) != (freeze_digest_b is None):
        named = label_a if freeze_digest_a is not None else label_b
        raise InputError(f"only run {named} names its freeze digest; cannot tell both ran the same split")
    if freeze_digest_a is not None and freeze_digest_a != freeze_digest_b:
        raise InputError(
            f"runs are on different freezes: {label_a} on {freeze_digest_a[:12]}, "
            f"{label_b} on {str(freeze_digest_b)[:12]}"
        )
    set_a, set_b = set(instances_a), set(instances_b)
    if set_a != set_b:
        only_a, only_b = sorted(set_a - set_b), sorted(set_b - set_a)
        raise InputError(
            f"runs are not on the same split: {len(only_a)} instances only in {label_a} {only_a[:5]}, "
            f"{len(only_b)} only in {label_b} {only_b[:5]}"
        )
    if not set_a:
        raise InputError(f"runs {label_a} and {label_b} have no instances to compare")
    return sorted(set_a)


class ExcludedTask(BaseModel):
    """An instance left out of the pairs, with the reason (``exception in A: SandboxOOMError``)."""

    model_config = ConfigDict(frozen=True)

    instance_id: str
    reason: str
    exception_a: str | None = None
    exception_b: str | None = None


# --- stored jobs: merged views, split check, the full comparison ------------------------------------
class MergedJob(BaseModel):
    """A job as stored, merged with the recovery jobs that re-ran its exception trials."""

    model_config = ConfigDict(frozen=True)

    job_id: str = Field(description="The original job.")
    recovery_job_ids: list[str] = Field(default_factory=list,
                                        description="Its recovery jobs, oldest first (empty: a plain job).")
    label: str = Field(
        description="job X or original job X + N recovery jobs (ids) — a merged view never presents itself as one "
                    "clean job.")
    freeze_name: str | None = Field(None,
                                    description="The frozen dataset the job ran (jobs table; None when the job has "
                                                "no row).")
    split: str | None = Field(None, description="The split of that freeze.")
    model_sha256: str | None = Field(None, description="The model the job evaluated.")
    recorded: bool = Field(True, description="False when the job has trials but no row in the jobs table.")
    trials: list[Any] = Field(default_factory=list, description="The trials standing for the job, one per instance.")
    from_recovery: dict[str, str] = Field(
        default_factory=dict,
        description="Instance id -> the recovery job whose trial replaced an exception.")

    @property
    def is_merged(self) -> bool:
        """True when recovery jobs are part of this view."""
        return bool(self.recovery_job_ids)

    def summary(self) -> dict[str, Any]:
        """JSON-ready description (no trials)."""
        return {"job_id": self.job_id, "label": self.label, "merged": self.is_merged,
                "recovery_job_ids": self.recovery_job_ids, "freeze_name": self.freeze_name, "split": self.split,
                "model_sha256": self.model_sha256, "recorded_in_jobs_table": self.recorded,
                "from_recovery": self.from_recovery}


RECOVERY_JOB_KIND = "recovery"
"""``jobs.kind`` of the jobs a merged view takes in: they re-ran their parent's exception trials
(:data:`forgeflow.evaluation.canary.RECOVERY_JOB_KIND`)."""


def _is_exception(trial: Any) -> bool:
    return trial.exception_type is not None


def merged_job(store: Any, job_id: str, *, include_recovery: bool = True) -> MergedJob:
    """The merged view of ``job_id`` and its recovery jobs (see :class:`MergedJob`).

    Raises:
        InputError: the job has no trials in the store (the message names the store URL), or it holds
            nop/oracle (validation) trials rather than agent trials.
    """
    kinds = store.job_trial_kinds(job_id)  # grouped in SQL: no trial is built to learn the kinds
    if not kinds:
        raise InputError(store.unknown_job_message(job_id))
    if kinds != ["agent"]:
        # a validation job holds a NOP and an Oracle trial per instance: "the latest trial of an
        # instance" would silently keep one of them and drop the other
        raise InputError(f"job {job_id!r} holds {'/'.join(kinds)} trials; a merged view and a paired compare "
                         f"take agent (canary) jobs only — see `forgeflow trials --job {job_id}`")
    row = store.get_job(job_id)
    recovery: list[str] = []
    frontier = [job_id]
    while frontier:  # recoveries of recoveries, breadth first, oldest first
        children = [j.job_id for parent in frontier for j in store.jobs(parent_job_id=parent, kind=RECOVERY_JOB_KIND)
                    if j.job_id not in recovery and j.job_id != job_id]
        recovery += children
        frontier = children
    # the latest live trial of each instance, picked in SQL (one row built per instance)
    latest: dict[str, Any] = {t.instance_id: t for t in store.latest_job_trials(job_id)}
    from_recovery: dict[str, str] = {}
    if include_recovery:
        for rec_id in recovery:
            for trial in store.latest_job_trials(rec_id):
                current = latest.get(trial.instance_id)
                if current is None or _is_exception(current) or trial.instance_id in from_recovery:
                    latest[trial.instance_id] = trial
                    from_recovery[trial.instance_id] = rec_id
    if recovery:
        label = (f"original job {job_id} + {len(recovery)} recovery job{'s' if len(recovery) != 1 else ''} "
                 f"({', '.join(recovery)})")
        if not include_recovery:
            label = f"job {job_id} alone (its {len(recovery)} recovery jobs not merged: {', '.join(recovery)})"
    else:
        label = f"job {job_id}"
    return MergedJob(
        job_id=job_id, recovery_job_ids=recovery, label=label,
        freeze_name=row.freeze_name if row else None, split=row.split if row else None,
        model_sha256=row.model_sha256 if row else None, recorded=row is not None,
        trials=[latest[i] for i in sorted(latest)], from_recovery=from_recovery,
    )


def refuse_unless_same_frozen_split(a: MergedJob, b: MergedJob) -> str:
    """Refuse two jobs that did not run the same frozen split; returns how it was checked (``freeze X, split Y``).

    Raises:
        InputError: naming the differing freeze/split (or instances), or the job lacking a row.
    """
    if a.recorded and b.recorded:
        diffs = [f"{name}: {a.job_id} has {va!r}, {b.job_id} has {vb!r}"
                 for name, va, vb in (("freeze", a.freeze_name, b.freeze_name), ("split", a.split, b.split))
                 if va != vb]
        if diffs:
            raise InputError(f"jobs are not on the same frozen split: {'; '.join(diffs)}")
        if a.freeze_name is None or a.split is None:
            raise InputError(f"jobs {a.job_id} and {b.job_id} do not name their frozen split (freeze_name/split "
                             "are empty in the jobs table): cannot tell they ran the same tasks")
        return f"freeze {a.freeze_name}, split {a.split} (jobs table)"
    if a.recorded != b.recorded:
        missing = b.job_id if a.recorded else a.job_id
        raise InputError(f"job {missing!r} has no row in the jobs table, so its frozen split is unknown; "
                         f"the other job ran freeze {(a if a.recorded else b).freeze_name!r}")
    refuse_unless_same_split([t.instance_id for t in a.trials], [t.instance_id for t in b.trials],
                             label_a=a.job_id, label_b=b.job_id)
    return "same instance ids (neither job is in the jobs table)"


def stored_costs(trial: Any) -> dict[str, float]:
    """``{"input_tokens", "agent_steps", "wall_s"}`` of a stored trial (the trial cost columns; wall
    seconds = ``timings`` agent_s + verifier_s, as :meth:`forgeflow.sandbox.trial.TrialResult.costs`)."""
    out: dict[str, float] = {}
    if trial.input_tokens is not None:
        out["input_tokens"] = float(trial.input_tokens)
    if trial.agent_steps is not None:
        out["agent_steps"] = float(trial.agent_steps)
    timings = trial.timings or {}
    if "agent_s" in timings:
        out["wall_s"] = float(timings["agent_s"]) + float(timings.get("verifier_s") or 0.0)
    return out


class ComparisonSettings(BaseModel):
    """How two stored canary jobs are compared and where the report goes: a parameter group of the
    ``promote`` flow, and the base of the ``compare`` flow's parameters (:func:`compare_stored_jobs`
    reads ``gate``, ``merge_recovery`` and ``seed``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gate: GatePolicy | None = Field(None, description="promotion gate settings; None: the defaults (30 pairs "
                                                      "from 3 repositories, 5 points of tolerated drop, alpha 0.05)")
    report_path: Path | None = Field(None, description="markdown report path (PNG beside it); None: "
                                                       "$FORGEFLOW_HOME/compare-<job_a>-vs-<job_b>.md")
    merge_recovery: bool = Field(True, description="merge each job's recovery jobs into it before comparing")
    seed: int = Field(0, description="seed of the repository-clustered bootstrap (same seed, same interval)")


class ComparisonFiles(BaseModel):
    """The markdown report and PNG plot written for a comparison, with their sha256s (64 hex)."""

    model_config = ConfigDict(frozen=True)

    report_path: Path
    report_sha256: str
    plot_path: Path
    plot_sha256: str


class StoredJobsComparison(BaseModel):
    """:func:`compare_stored_jobs`'s result (``_a`` / ``_b``: the baseline's and the candidate's), and the
    ``compare`` flow's, with the files it wrote."""

    model_config = ConfigDict(frozen=True)

    job_a: MergedJob = Field(description="the merged view compared (original job + its recovery jobs).")
    job_b: MergedJob
    split_checked: str = Field(description="how the same frozen split was established.")
    report_a: JobReport = Field(description="per-run accounting.")
    report_b: JobReport
    paired: PairedComparison = Field(
        description="wins/ties/losses, McNemar, the delta interval (clustered by repository when every paired "
                    "instance has a task_instances row, else by instance).")
    excluded: list[ExcludedTask] = Field(description="instances left out of the pairs, with reasons.")
    costs: CostComparison = Field(
        description="mean input tokens, agent steps and wall seconds over the pairs, ratios B / A.")
    decision: Decision = Field(
        description="the promotion gate's verdict on the pairs and the cost ratios (hold when a job is unusable).")
    markdown: str = Field(description="the report a person reads.")
    exclusions_a: JobExclusions | None = Field(
        None, description="the job's trials excluded as exceptions, per type with the rate; whether it is unusable.")
    exclusions_b: JobExclusions | None = None
    files: ComparisonFiles | None = Field(
        None, description="the markdown report and its PNG, with sha256 (set by the compare flow once written; "
                          "None: nothing written).")

    def to_json(self) -> dict[str, Any]:
        """What ``forgeflow compare --json`` prints: the paired fields at the top level, then the runs, split,
        reports, excluded tasks, ``exclusions``, cost ratios and ``promotion`` (the gate's decision)."""
        return {
            "job_a": self.job_a.job_id, "job_b": self.job_b.job_id,
            **self.paired.model_dump(mode="json"),
            "runs": {"a": self.job_a.summary(), "b": self.job_b.summary()},
            "split_checked": self.split_checked,
            "report_a": self.report_a.model_dump(mode="json"), "report_b": self.report_b.model_dump(mode="json"),
            "excluded_tasks": [e.model_dump(mode="json") for e in self.excluded],
            "exclusions": {run: None if ex is None else ex.model_dump(mode="json")
                           for run, ex in (("a", self.exclusions_a), ("b", self.exclusions_b))},
            "costs": self.costs.model_dump(mode="json"),
            "promotion": self.decision.model_dump(mode="json"),
        }


def excluded_tasks(trials_a: Iterable[Any], trials_b: Iterable[Any]) -> list[ExcludedTask]:
    """The instances :func:`paired_compare` leaves out, each with its reason: ``no trial in A``,
    ``exception in A: <type>``, ``exception in B: <type>`` or both (sorted by instance id)."""
    by_a = {t.instance_id: t for t in trials_a}
    by_b = {t.instance_id: t for t in trials_b}
    out = []
    for instance_id in sorted(set(by_a) | set(by_b)):
        ta, tb = by_a.get(instance_id), by_b.get(instance_id)
        if ta is None or tb is None:
            out.append(ExcludedTask(instance_id=instance_id, reason=f"no trial in {'A' if ta is None else 'B'}"))
            continue
        ea, eb = ta.exception_type, tb.exception_type
        if ea is None and eb is None:
            continue
        parts = [f"exception in {run}: {exc}" for run, exc in (("A", ea), ("B", eb)) if exc is not None]
        out.append(ExcludedTask(instance_id=instance_id, reason="; ".join(parts), exception_a=ea, exception_b=eb))
    return out


def compare_stored_jobs(
    store: Any, job_a: str, job_b: str, *, merge_recovery: bool = True, n_resamples: int = 2000,
    seed: int = 0, confidence: float | None = None, plot_file: str | None = None, gate: GatePolicy | None = None,
) -> StoredJobsComparison:
    """Compare two jobs recorded in a :class:`forgeflow.ledger.store.Store` (void trials excluded).

    Raises:
        InputError: a job has no trials (named with the store URL), holds non-agent trials, both ids are
            the same job, the jobs are not on the same frozen split, or ``confidence`` is not ``1 - gate.alpha``.
    """
    if job_a == job_b:
        raise InputError(f"both runs are job {job_a!r}: compare takes two different canary jobs")
    gate = gate or GatePolicy()
    confidence = 1.0 - gate.alpha if confidence is None else confidence
    a = merged_job(store, job_a, include_recovery=merge_recovery)
    b = merged_job(store, job_b, include_recovery=merge_recovery)
    split_checked = refuse_unless_same_frozen_split(a, b)
    rewards_a, rewards_b = rewards_by_instance(a.trials), rewards_by_instance(b.trials)
    paired_ids = [i for i in sorted(set(rewards_a) & set(rewards_b))
                  if rewards_a[i] is not None and rewards_b[i] is not None]
    repos = store.task_repos(paired_ids)  # one read per 500 ids, not one per task
    repo_of: dict[str, str] | None = repos if all(i in repos for i in paired_ids) else None
    paired = paired_compare(rewards_a, rewards_b, repo_of, n_resamples=n_resamples, seed=seed,
                            confidence=confidence)
    report_a, report_b = JobReport.from_trials(a.trials), JobReport.from_trials(b.trials)
    costs = cost_ratios({t.instance_id: stored_costs(t) for t in a.trials},
                        {t.instance_id: stored_costs(t) for t in b.trials}, paired_ids)
    excluded = excluded_tasks(a.trials, b.trials)
    exclusions_a = job_exclusions(report_a, job_a, gate.max_exception_rate)
    exclusions_b = job_exclusions(report_b, job_b, gate.max_exception_rate)
    unusable = [ex.reason for ex in (exclusions_a, exclusions_b) if ex.reason is not None]
    decision = promotion_decision(paired, gate, costs=costs, unusable=unusable)
    notes = [f"**not compared: {reason}**" for reason in unusable]
    notes += [f"A = {a.label}", f"B = {b.label}", f"same frozen split: {split_checked}"]
    if repo_of is None and paired_ids:
        notes.append("delta interval clustered by instance: some paired instances have no task_instances row "
                     "(no repository known)")
    if excluded:
        notes.append("excluded from the pairs: " + "; ".join(f"{e.instance_id} ({e.reason})" for e in excluded))
    notes += [f"exclusions of {label} ({job}): {ex.describe()}" for label, job, ex in
              (("A", job_a, exclusions_a), ("B", job_b, exclusions_b))]
    markdown = render_markdown(report_a, report_b, paired, job_a, job_b, costs=costs, decision=decision,
                               notes=notes, plot_file=plot_file)
    markdown += "".join(f"\n### Exclusions of {job}\n\n" + "\n".join(exclusion_lines(ex)) + "\n"
                        for job, ex in ((job_a, exclusions_a), (job_b, exclusions_b)))
    return StoredJobsComparison(job_a=a, job_b=b, split_checked=split_checked, report_a=report_a,
                                report_b=report_b, paired=paired, excluded=excluded, costs=costs,
                                decision=decision, markdown=markdown, exclusions_a=exclusions_a,
                                exclusions_b=exclusions_b)
