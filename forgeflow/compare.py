"""Job reports and paired comparisons of two evaluation runs (canary A vs B).

Outcomes are binary: a scored trial *passes* when its reward is >= 1.0 (all FAIL_TO_PASS and
PASS_TO_PASS tests pass, SWE-bench's "resolved"). A trial that ended in an infrastructure
exception has no reward: it is counted by exception type, never as a failure of the model, and
it is left out of the paired comparison (as SWE-bench keeps infra failures out of the score).

Statistics (statsmodels):

* Wilson score interval for a pass rate: ``statsmodels.stats.proportion.proportion_confint``
  with ``method="wilson"`` (Wilson 1927; recommended over the normal interval by Brown, Cai and
  DasGupta 2001, "Interval Estimation for a Binomial Proportion").
* McNemar's exact test on the discordant pairs of a paired comparison:
  ``statsmodels.stats.contingency_tables.mcnemar(table, exact=True)`` (a two-sided binomial
  test with p = 0.5 on the pairs where exactly one run passed; McNemar 1947).
* Paired interval on the delta (:mod:`forgeflow.paired_stats`): the union of Newcombe's hybrid
  score interval for paired proportions (Newcombe 1998, Statistics in Medicine 17:2635-2650,
  method 10; valid at small n) and a cluster bootstrap that resamples whole repositories (Field
  and Welsh 2007, "Bootstrapping clustered data", JRSS B 69(3); Miller 2024, "Adding Error Bars to
  Evals", arXiv:2411.00640), so it is never narrower than either and never of zero width. numpy
  ``default_rng(seed)``: the same seed gives the same interval.

Before comparing, :func:`refuse_unless_same_split` checks that both runs ran the same frozen split,
and :func:`promotion_decision` (:mod:`forgeflow.gate`) turns a comparison and its cost ratios into
promote / hold / reject: it needs enough pairs, repositories and an interval that excludes the
allowed drop, and it holds when a cost ratio is over its limit.

Jobs recorded in the store are compared by :func:`compare_stored_jobs`: each job is read as a
:class:`MergedJob` (the original plus its recovery jobs, labelled "original job X + N recovery
jobs"), :func:`refuse_unless_same_frozen_split` reads the jobs table's freeze and split, the delta
interval is clustered by ``task_instances.repo``, excluded tasks carry their reasons, and the cost
ratios come from the stored trial columns. :func:`render_plot` draws the pass rates with their
Wilson intervals and the wins/losses per repository (matplotlib, Agg canvas).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field
from statsmodels.stats.contingency_tables import mcnemar
from statsmodels.stats.proportion import proportion_confint

from forgeflow.errors import SCORED_DESPITE_EXCEPTION, InputError
# the gate and the intervals live in their own modules; their names stay importable from here
from forgeflow.gate import CostCheck, Decision, GatePolicy, promotion_decision  # noqa: F401
from forgeflow.paired_stats import (  # noqa: F401
    ClusteredInterval,
    DeltaInterval,
    NewcombeInterval,
    cluster_bootstrap_delta,
    newcombe_paired_interval,
    union_interval,
)

PASS_REWARD = 1.0
"""A scored trial passes when ``reward >= PASS_REWARD``."""


class Interval(BaseModel):
    """A confidence interval for a proportion, both ends in [0, 1]."""

    model_config = ConfigDict(frozen=True)

    low: float = Field(ge=0.0, le=1.0)
    high: float = Field(ge=0.0, le=1.0)
    confidence: float = Field(default=0.95, gt=0.0, lt=1.0)


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> Interval:
    """Wilson score interval for ``successes`` out of ``n``.

    With ``n == 0`` nothing is known and the interval is [0, 1].

    Raises:
        InputError: ``n < 0``, ``successes`` outside ``[0, n]`` or ``confidence`` outside (0, 1).
    """
    if not 0.0 < confidence < 1.0:
        raise InputError(f"confidence must be in (0, 1), got {confidence}")
    if n < 0 or not 0 <= successes <= n:
        raise InputError(
            f"wilson_interval needs 0 <= successes <= n, got successes={successes}, n={n}"
        )
    if n == 0:
        return Interval(low=0.0, high=1.0, confidence=confidence)
    low, high = proportion_confint(successes, n, alpha=1.0 - confidence, method="wilson")
    # At 0 or n successes the Wilson bound is exactly 0 or 1; pin it against rounding error.
    low = 0.0 if successes == 0 else max(0.0, float(low))
    high = 1.0 if successes == n else min(1.0, float(high))
    return Interval(low=low, high=high, confidence=confidence)


class TrialOutcome(Protocol):
    """What a report reads from a trial (``forgeflow.store.TrialRecord`` fits)."""

    instance_id: str
    reward: float | None
    exception_type: str | None


def _passed(reward: float) -> bool:
    return reward >= PASS_REWARD


class JobReport(BaseModel):
    """The outcome counts of one evaluation job.

    Attributes:
        requested: Trials the job asked for (>= the trials that came back).
        scored: Trials with a reward (no exception).
        exceptions_by_type: Exception class name -> count.
        missing: Requested trials that produced no record at all.
        reward_1: Scored trials that passed (reward >= 1.0).
        reward_0: Scored trials that did not pass.
        pass_rate_scored: ``reward_1 / scored`` (0 when nothing was scored).
        pass_rate_attempts: ``reward_1 / requested`` (exceptions and missing count as not passed).
        wilson: Wilson interval of ``reward_1`` out of ``scored``.
        flagged: Exception trials that still carry the verifier's reward (agent timeout, dead
            loop, hang: :data:`forgeflow.errors.SCORED_DESPITE_EXCEPTION`, Harbor's convention).
            They are counted under their exception type and are *not* in ``scored`` or the pass
            rates (the run was cut short by the harness).
        flagged_reward_1: Of those, how many the verifier passed anyway.
    """

    model_config = ConfigDict(frozen=True)

    requested: int = Field(ge=0)
    scored: int = Field(ge=0)
    exceptions_by_type: dict[str, int]
    missing: int = Field(ge=0)
    reward_1: int = Field(ge=0)
    reward_0: int = Field(ge=0)
    pass_rate_scored: float = Field(ge=0.0, le=1.0)
    pass_rate_attempts: float = Field(ge=0.0, le=1.0)
    wilson: Interval
    flagged: int = Field(default=0, ge=0)
    flagged_reward_1: int = Field(default=0, ge=0)

    @property
    def exceptions(self) -> int:
        """Total trials that ended in an exception."""
        return sum(self.exceptions_by_type.values())

    @classmethod
    def from_trials(
        cls, trials: Iterable[TrialOutcome], requested: int | None = None, confidence: float = 0.95
    ) -> JobReport:
        """Count a job's trials.

        Args:
            trials: The job's trials; each has either a reward or an exception type.
            requested: Trials asked for (default: the number of trials given).
            confidence: Level of the Wilson interval.

        Raises:
            InputError: a trial has neither reward nor exception type, or both (allowed only for
                the exception types in :data:`~forgeflow.errors.SCORED_DESPITE_EXCEPTION`), or
                ``requested`` is smaller than the number of trials.
        """
        rows = list(trials)
        total = len(rows) if requested is None else requested
        if total < len(rows):
            raise InputError(f"requested={total} is smaller than the {len(rows)} trials given")
        exceptions: Counter[str] = Counter()
        passed = failed = flagged = flagged_passed = 0
        for trial in rows:
            both = trial.reward is not None and trial.exception_type is not None
            if (trial.reward is None and trial.exception_type is None) or (
                both and trial.exception_type not in SCORED_DESPITE_EXCEPTION
            ):
                raise InputError(
                    f"trial for {trial.instance_id!r} must have exactly one of reward "
                    f"({trial.reward!r}) and exception_type ({trial.exception_type!r})"
                )
            if trial.exception_type is not None:
                exceptions[trial.exception_type] += 1
                if both:
                    flagged += 1
                    flagged_passed += int(_passed(trial.reward))
            elif _passed(trial.reward):
                passed += 1
            else:
                failed += 1
        scored = passed + failed
        return cls(
            requested=total,
            scored=scored,
            exceptions_by_type=dict(sorted(exceptions.items())),
            missing=total - len(rows),
            reward_1=passed,
            reward_0=failed,
            pass_rate_scored=passed / scored if scored else 0.0,
            pass_rate_attempts=passed / total if total else 0.0,
            wilson=wilson_interval(passed, scored, confidence),
            flagged=flagged,
            flagged_reward_1=flagged_passed,
        )


class PairCounts(BaseModel):
    """Paired outcomes within one group (a repository)."""

    model_config = ConfigDict(frozen=True)

    n_pairs: int = Field(ge=0)
    wins: int = Field(ge=0)
    ties: int = Field(ge=0)
    losses: int = Field(ge=0)


class PairedComparison(BaseModel):
    """Run B against baseline run A on the instances both scored.

    Attributes:
        n_pairs: Instances scored in both runs.
        wins: Pairs where B passed and A did not.
        ties: Pairs with the same outcome (``both_pass + both_fail``).
        losses: Pairs where A passed and B did not.
        both_pass: Pairs where both passed.
        both_fail: Pairs where neither passed.
        pass_rate_a: A's pass rate over the pairs.
        pass_rate_b: B's pass rate over the pairs.
        delta: ``pass_rate_b - pass_rate_a`` (= ``(wins - losses) / n_pairs``).
        mcnemar_p: Two-sided exact McNemar p-value (1.0 with no discordant pairs).
        excluded_exception: Instances left out because either run had an exception (sorted).
        excluded_missing: Instances present in only one run (sorted).
        per_repo: Repository -> pair counts (only when ``repo_of`` was given).
        delta_interval: The reported interval on ``delta``: Newcombe's paired interval united with
            the cluster bootstrap (by repository when ``repo_of`` was given, else by instance);
            each alone in ``.newcombe`` / ``.bootstrap`` (None when there are no pairs).
    """

    model_config = ConfigDict(frozen=True)

    n_pairs: int = Field(ge=0)
    wins: int = Field(ge=0)
    ties: int = Field(ge=0)
    losses: int = Field(ge=0)
    both_pass: int = Field(ge=0)
    both_fail: int = Field(ge=0)
    pass_rate_a: float = Field(ge=0.0, le=1.0)
    pass_rate_b: float = Field(ge=0.0, le=1.0)
    delta: float = Field(ge=-1.0, le=1.0)
    mcnemar_p: float = Field(ge=0.0, le=1.0)
    excluded_exception: list[str]
    excluded_missing: list[str]
    per_repo: dict[str, PairCounts] = Field(default_factory=dict)
    delta_interval: DeltaInterval | None = None


def paired_compare(
    a: Mapping[str, float | None],
    b: Mapping[str, float | None],
    repo_of: Mapping[str, str] | None = None,
    *,
    n_resamples: int = 2000,
    seed: int = 0,
    confidence: float = 0.95,
) -> PairedComparison:
    """Compare run B with baseline run A instance by instance.

    Args:
        a: Instance id -> reward in run A; None means the trial ended in an exception.
        b: Instance id -> reward in run B; None likewise.
        repo_of: Instance id -> repository, for the per-repository breakdown and the clustered
            interval (optional; must cover every paired instance).
        n_resamples: Bootstrap resamples of the delta interval.
        seed: Seed of the bootstrap.
        confidence: Level of the delta interval.

    Returns:
        Counts, pass rates over the pairs, McNemar's exact p-value on the 2x2 table
        ``[[both_pass, losses], [wins, both_fail]]`` (rows A pass/fail, columns B pass/fail) and
        the union of :func:`~forgeflow.paired_stats.newcombe_paired_interval` and
        :func:`cluster_bootstrap_delta` (:class:`~forgeflow.paired_stats.DeltaInterval`).

    Raises:
        InputError: ``repo_of`` lacks a paired instance, or a bootstrap parameter is invalid.
    """
    excluded_missing = sorted(set(a) ^ set(b))
    excluded_exception: list[str] = []
    pairs: list[tuple[str, bool, bool]] = []
    for instance_id in sorted(set(a) & set(b)):
        reward_a, reward_b = a[instance_id], b[instance_id]
        if reward_a is None or reward_b is None:
            excluded_exception.append(instance_id)
        else:
            pairs.append((instance_id, _passed(reward_a), _passed(reward_b)))

    def count(group: list[tuple[str, bool, bool]]) -> tuple[int, int, int, int]:
        both_pass = sum(pa and pb for _, pa, pb in group)
        both_fail = sum(not pa and not pb for _, pa, pb in group)
        wins = sum(pb and not pa for _, pa, pb in group)
        losses = sum(pa and not pb for _, pa, pb in group)
        return both_pass, both_fail, wins, losses

    both_pass, both_fail, wins, losses = count(pairs)
    n_pairs = len(pairs)
    if wins + losses == 0:
        p_value = 1.0
    else:
        p_value = float(mcnemar([[both_pass, losses], [wins, both_fail]], exact=True).pvalue)

    per_repo: dict[str, PairCounts] = {}
    if repo_of is not None:
        unknown = [instance_id for instance_id, _, _ in pairs if instance_id not in repo_of]
        if unknown:
            raise InputError(f"repo_of has no repository for paired instances {unknown[:5]}")
        grouped: dict[str, list[tuple[str, bool, bool]]] = {}
        for pair in pairs:
            grouped.setdefault(repo_of[pair[0]], []).append(pair)
        for repo in sorted(grouped):
            bp, bf, w, lo = count(grouped[repo])
            per_repo[repo] = PairCounts(n_pairs=len(grouped[repo]), wins=w, ties=bp + bf, losses=lo)

    interval = (
        union_interval(
            newcombe_paired_interval(both_pass, wins, losses, both_fail, confidence),
            cluster_bootstrap_delta(
                {i: (pa, pb) for i, pa, pb in pairs},
                repo_of,
                n_resamples=n_resamples,
                seed=seed,
                confidence=confidence,
            ),
        )
        if pairs
        else None
    )
    rate_a = (both_pass + losses) / n_pairs if n_pairs else 0.0
    rate_b = (both_pass + wins) / n_pairs if n_pairs else 0.0
    return PairedComparison(
        n_pairs=n_pairs,
        wins=wins,
        ties=both_pass + both_fail,
        losses=losses,
        both_pass=both_pass,
        both_fail=both_fail,
        pass_rate_a=rate_a,
        pass_rate_b=rate_b,
        delta=(wins - losses) / n_pairs if n_pairs else 0.0,
        mcnemar_p=min(1.0, p_value),
        excluded_exception=excluded_exception,
        excluded_missing=excluded_missing,
        per_repo=per_repo,
        delta_interval=interval,
    )


def _pct(value: float) -> str:
    return f"{100.0 * value:.1f}%"


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


# --- cost ratios ---------------------------------------------------------------------------------
COST_METRICS = ("input_tokens", "agent_steps", "wall_s")
"""Keys read from the per-trial cost dicts: model input tokens, agent steps, wall seconds."""


class CostMetric(BaseModel):
    """One cost metric of both runs over the same instances.

    Attributes:
        name: ``input_tokens``, ``agent_steps`` or ``wall_s``.
        n: Instances where both runs recorded the metric (the means are over these).
        mean_a: Mean in run A (None when ``n == 0``).
        mean_b: Mean in run B.
        ratio: ``mean_b / mean_a`` (None when either is missing or ``mean_a == 0``).
    """

    model_config = ConfigDict(frozen=True)

    name: str
    n: int = Field(ge=0)
    mean_a: float | None = Field(default=None, ge=0.0)
    mean_b: float | None = Field(default=None, ge=0.0)
    ratio: float | None = Field(default=None, ge=0.0)


class CostComparison(BaseModel):
    """Mean costs of run B relative to run A (ratio < 1: B is cheaper)."""

    model_config = ConfigDict(frozen=True)

    input_tokens: CostMetric
    agent_steps: CostMetric
    wall_s: CostMetric


def cost_ratios(
    costs_a: Mapping[str, Mapping[str, float]],
    costs_b: Mapping[str, Mapping[str, float]],
    instance_ids: Iterable[str] | None = None,
) -> CostComparison:
    """Mean input tokens, agent steps and wall seconds of both runs, and their ratios B / A.

    Each metric is averaged over the instances where *both* runs recorded it, so the ratio
    compares like with like (an instance one run skipped does not make it look cheaper).

    Args:
        costs_a: Instance id -> ``{"input_tokens": .., "agent_steps": .., "wall_s": ..}`` in run
            A (missing keys allowed).
        costs_b: The same for run B.
        instance_ids: Instances to include (default: those in both mappings; pass
            ``comparison``'s paired instances to restrict the costs to the pairs).

    Returns:
        :class:`CostComparison`.

    Raises:
        InputError: a value is negative or not a finite number (named with its instance).
    """
    ids = sorted(set(costs_a) & set(costs_b) if instance_ids is None else set(instance_ids))

    def value(costs: Mapping[str, Mapping[str, float]], run: str, instance_id: str, key: str) -> float | None:
        raw = costs.get(instance_id, {}).get(key)
        if raw is None:
            return None
        if isinstance(raw, bool) or not isinstance(raw, int | float) or not (0.0 <= raw < float("inf")):
            raise InputError(f"run {run} cost {key!r} of {instance_id!r} must be a finite number >= 0, got {raw!r}")
        return float(raw)

    metrics: dict[str, CostMetric] = {}
    for key in COST_METRICS:
        both = [
            (va, vb)
            for i in ids
            if (va := value(costs_a, "A", i, key)) is not None and (vb := value(costs_b, "B", i, key)) is not None
        ]
        if not both:
            metrics[key] = CostMetric(name=key, n=0)
            continue
        mean_a = sum(va for va, _ in both) / len(both)
        mean_b = sum(vb for _, vb in both) / len(both)
        metrics[key] = CostMetric(
            name=key, n=len(both), mean_a=mean_a, mean_b=mean_b, ratio=mean_b / mean_a if mean_a > 0 else None
        )
    return CostComparison(**metrics)


# --- same split -------------------------------------------------------------------------------
def refuse_unless_same_split(
    instances_a: Iterable[str],
    instances_b: Iterable[str],
    freeze_digest_a: str | None = None,
    freeze_digest_b: str | None = None,
    label_a: str = "A",
    label_b: str = "B",
) -> list[str]:
    """Refuse to compare two runs that did not run the same frozen split.

    Args:
        instances_a: Instance ids run A was asked to run (its requested split, not only the
            trials that came back).
        instances_b: The same for run B.
        freeze_digest_a: Semantic sha256 of run A's freeze manifest (optional).
        freeze_digest_b: The same for run B; compared when both are given.
        label_a: Name of run A in the message.
        label_b: Name of run B.

    Returns:
        The shared instance ids, sorted.

    Raises:
        InputError: the freeze digests differ, only one run names a digest, or the instance
            sets differ; the message names the digests or the first differing ids and counts.
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


def render_markdown(
    report_a: JobReport,
    report_b: JobReport,
    comparison: PairedComparison,
    label_a: str = "A",
    label_b: str = "B",
    *,
    costs: CostComparison | None = None,
    decision: Decision | None = None,
    notes: Iterable[str] = (),
    plot_file: str | None = None,
) -> str:
    """A Markdown summary a person reads: per-run counts side by side, then the paired result.

    Args:
        report_a: Job report of the baseline run.
        report_b: Job report of the candidate run.
        comparison: Their paired comparison.
        label_a: Name of run A in the tables.
        label_b: Name of run B.
        costs: Cost ratios (optional table).
        decision: Promotion decision (optional line).
        notes: Lines printed under the title (e.g. what each run merges, the split checked).
        plot_file: Image path (relative to the markdown file) embedded after the tables.

    Returns:
        Markdown text (two tables, a verdict line, the delta interval, and when present a
        per-repository table, a cost table and the promotion decision).
    """
    exception_types = sorted(set(report_a.exceptions_by_type) | set(report_b.exceptions_by_type))

    def interval(report: JobReport) -> str:
        return f"{_pct(report.wilson.low)} to {_pct(report.wilson.high)}"

    level = f"{100 * report_a.wilson.confidence:g}%"
    rows = [
        ("trials requested", str(report_a.requested), str(report_b.requested)),
        ("scored", str(report_a.scored), str(report_b.scored)),
        ("passed (reward 1)", str(report_a.reward_1), str(report_b.reward_1)),
        ("failed (reward 0)", str(report_a.reward_0), str(report_b.reward_0)),
        ("exceptions", str(report_a.exceptions), str(report_b.exceptions)),
        *(
            (("flagged: reward kept beside the exception (not scored)",
              f"{report_a.flagged} ({report_a.flagged_reward_1} passed)",
              f"{report_b.flagged} ({report_b.flagged_reward_1} passed)"),)
            if report_a.flagged or report_b.flagged
            else ()
        ),
        *(
            (
                f"exception: {name}",
                str(report_a.exceptions_by_type.get(name, 0)),
                str(report_b.exceptions_by_type.get(name, 0)),
            )
            for name in exception_types
        ),
        ("missing", str(report_a.missing), str(report_b.missing)),
        ("pass rate (scored)", _pct(report_a.pass_rate_scored), _pct(report_b.pass_rate_scored)),
        (f"Wilson {level} interval", interval(report_a), interval(report_b)),
        (
            "pass rate (all attempts)",
            _pct(report_a.pass_rate_attempts),
            _pct(report_b.pass_rate_attempts),
        ),
    ]
    lines = [f"## {label_b} vs {label_a}", ""]
    lines += [f"- {note}" for note in notes]
    lines += [""] if lines[-1] != "" else []
    lines += [f"| | {label_a} | {label_b} |", "|---|---:|---:|"]
    lines += [f"| {name} | {va} | {vb} |" for name, va, vb in rows]
    c = comparison
    lines += [
        "",
        f"### Paired on {c.n_pairs} instances scored in both runs",
        "",
        "| pairs | wins | ties | losses | "
        f"{label_a} pass rate | {label_b} pass rate | delta | McNemar exact p |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {c.n_pairs} | {c.wins} | {c.ties} | {c.losses} | {_pct(c.pass_rate_a)} | "
        f"{_pct(c.pass_rate_b)} | {100 * c.delta:+.1f} pp | {c.mcnemar_p:.3g} |",
        "",
        f"Wins: {label_b} passed and {label_a} did not; losses: the reverse. "
        f"Excluded: {len(c.excluded_exception)} with an exception in either run, "
        f"{len(c.excluded_missing)} present in only one run.",
    ]
    if c.delta_interval is not None:
        ci = c.delta_interval
        nc, bs = ci.newcombe, ci.bootstrap
        lines += [
            "",
            f"Delta {100 * ci.confidence:g}% interval: {100 * ci.low:+.1f} pp to {100 * ci.high:+.1f} pp, the union "
            f"of Newcombe's hybrid score interval for paired proportions "
            f"{100 * nc.low:+.1f} to {100 * nc.high:+.1f} pp ({nc.source}) and a cluster bootstrap by "
            f"{bs.clustered_by} {100 * bs.low:+.1f} to {100 * bs.high:+.1f} pp "
            f"({ci.n_clusters} clusters, {bs.n_resamples} resamples, seed {bs.seed}; Field and Welsh 2007).",
        ]
        if bs.high - bs.low <= 0.0:
            lines[-1] += (" The bootstrap alone has zero width (too few clusters or no discordant pair); it is "
                          "never reported alone.")
    if c.per_repo:
        lines += ["", "| repository | pairs | wins | ties | losses |", "|---|---:|---:|---:|---:|"]
        lines += [
            f"| {repo} | {pc.n_pairs} | {pc.wins} | {pc.ties} | {pc.losses} |"
            for repo, pc in c.per_repo.items()
        ]
    if costs is not None:
        lines += ["", f"| cost (mean per paired trial) | {label_a} | {label_b} | ratio {label_b}/{label_a} |",
                  "|---|---:|---:|---:|"]
        for metric in (costs.input_tokens, costs.agent_steps, costs.wall_s):
            lines.append(
                f"| {metric.name} | {_num(metric.mean_a)} | {_num(metric.mean_b)} | {_num(metric.ratio)} |"
            )
    if decision is not None:
        lines += ["", f"**Promotion gate: {decision.verdict}** ({decision.reason})"]
        if decision.costs:
            lines += ["", "Cost limits (B / A): " + "; ".join(check.describe() for check in decision.costs) + "."]
    if plot_file is not None:
        lines += ["", f"![pass rates with Wilson intervals; wins and losses per repository]({plot_file})"]
    return "\n".join(lines) + "\n"


class ExcludedTask(BaseModel):
    """An instance left out of the pairs, with the reason (``exception in A: SandboxOOMError``)."""

    model_config = ConfigDict(frozen=True)

    instance_id: str
    reason: str
    exception_a: str | None = None
    exception_b: str | None = None


class CanaryComparison(BaseModel):
    """Everything the compare stage reports about two canary jobs on one frozen split.

    Attributes:
        report_a / report_b: per-job accounting (baseline, candidate).
        paired: the paired comparison (wins/ties/losses, McNemar, clustered interval).
        decision: the promotion gate's verdict.
        costs: mean input tokens, agent steps and wall seconds over the pairs, ratios B / A.
        markdown: the report a person reads.
        excluded: instances left out of the pairs, with reasons.
    """

    model_config = ConfigDict(frozen=True)

    report_a: JobReport
    report_b: JobReport
    paired: PairedComparison
    decision: Decision
    costs: CostComparison
    markdown: str
    excluded: list[ExcludedTask] = Field(default_factory=list)


def rewards_by_instance(trials: Iterable[Any]) -> dict[str, float | None]:
    """``instance_id -> reward`` for :func:`paired_compare`; a trial that ended in an exception maps
    to None (excluded from the pairs and counted), never to reward 0.

    Args:
        trials: records with ``instance_id``, ``reward`` and ``exception_type`` (core or store rows).
    """
    return {t.instance_id: t.reward if t.exception_type is None else None for t in trials}


# --- stored jobs: merged views, split check, the full comparison ------------------------------------
class MergedJob(BaseModel):
    """A job as stored, merged with the recovery jobs that re-ran its exception trials.

    A recovery job names its original in ``jobs.parent_job_id`` (recoveries of a recovery count
    too). Each instance keeps the original's trial unless that trial ended in an exception and a
    recovery job has a trial for the instance: then the latest recovery trial stands, and the
    instance is listed in ``from_recovery``. The original's rows are never rewritten.

    Attributes:
        job_id: The original job.
        recovery_job_ids: Its recovery jobs, oldest first (empty: a plain job).
        label: ``job X`` or ``original job X + N recovery jobs (ids)`` — a merged view never
            presents itself as one clean job.
        freeze_name: The frozen dataset the job ran (jobs table; None when the job has no row).
        split: The split of that freeze.
        model_sha256: The model the job evaluated.
        recorded: False when the job has trials but no row in the jobs table.
        trials: The trials standing for the job, one per instance.
        from_recovery: Instance id -> the recovery job whose trial replaced an exception.
    """

    model_config = ConfigDict(frozen=True)

    job_id: str
    recovery_job_ids: list[str] = Field(default_factory=list)
    label: str
    freeze_name: str | None = None
    split: str | None = None
    model_sha256: str | None = None
    recorded: bool = True
    trials: list[Any] = Field(default_factory=list)
    from_recovery: dict[str, str] = Field(default_factory=dict)

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


def _is_exception(trial: Any) -> bool:
    return trial.exception_type is not None


def merged_job(store: Any, job_id: str, *, include_recovery: bool = True) -> MergedJob:
    """The merged view of ``job_id`` and its recovery jobs (see :class:`MergedJob`).

    Args:
        store: a :class:`forgeflow.store.Store`.
        job_id: the original job.
        include_recovery: False: the job's own trials only (recovery jobs still named in the label).

    Raises:
        InputError: the job has no trials in the store (the message names the store URL), or it holds
            nop/oracle (validation) trials rather than agent trials.
    """
    own = store.trials_for(job_id=job_id)
    if not own:
        known = sorted({t.job_id for t in store.trials_for() if t.job_id})
        raise InputError(f"job {job_id!r} has no trials in {store.url}; jobs with trials: {', '.join(known) or 'none'}")
    kinds = sorted({t.kind for t in own})
    if kinds != ["agent"]:
        # a validation job holds a NOP and an Oracle trial per instance: "the latest trial of an
        # instance" would silently keep one of them and drop the other
        raise InputError(f"job {job_id!r} holds {'/'.join(kinds)} trials; a merged view and a paired compare "
                         f"take agent (canary) jobs only — see `forgeflow trials --job {job_id}`")
    row = store.get_job(job_id)
    recovery: list[str] = []
    frontier = [job_id]
    while frontier:  # recoveries of recoveries, breadth first, oldest first
        children = [j.job_id for parent in frontier for j in store.jobs(parent_job_id=parent)
                    if j.job_id not in recovery and j.job_id != job_id]
        recovery += children
        frontier = children
    latest: dict[str, Any] = {}
    for trial in own:  # trials_for orders by created_at: the latest trial of an instance wins
        latest[trial.instance_id] = trial
    from_recovery: dict[str, str] = {}
    if include_recovery:
        for rec_id in recovery:
            for trial in store.trials_for(job_id=rec_id):
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
    """Refuse two jobs that did not run the same frozen split (the jobs table's freeze and split).

    Both jobs recorded in the jobs table: their ``freeze_name`` and ``split`` must match. Neither
    recorded (trials imported without a job row): the instance sets must match
    (:func:`refuse_unless_same_split`). One recorded and not the other: refused.

    Returns:
        How the split was checked, for the report (e.g. ``freeze demo-v1, split test``).

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
    seconds = ``timings`` agent_s + verifier_s, as :meth:`forgeflow.trial.TrialRecord.costs`)."""
    out: dict[str, float] = {}
    if trial.input_tokens is not None:
        out["input_tokens"] = float(trial.input_tokens)
    if trial.agent_steps is not None:
        out["agent_steps"] = float(trial.agent_steps)
    timings = trial.timings or {}
    if "agent_s" in timings:
        out["wall_s"] = float(timings["agent_s"]) + float(timings.get("verifier_s") or 0.0)
    return out


class StoredJobsComparison(BaseModel):
    """:func:`compare_stored_jobs`'s result.

    Attributes:
        job_a / job_b: the merged views compared (labels say "original job + N recovery jobs").
        split_checked: how the same frozen split was established.
        report_a / report_b: per-run accounting.
        paired: wins/ties/losses, McNemar, the delta interval (clustered by repository when every
            paired instance has a ``task_instances`` row, else by instance).
        excluded: instances left out of the pairs, with reasons.
        costs: mean input tokens, agent steps and wall seconds over the pairs, ratios B / A.
        decision: the promotion gate's verdict on the pairs and the cost ratios.
        markdown: the report a person reads.
    """

    model_config = ConfigDict(frozen=True)

    job_a: MergedJob
    job_b: MergedJob
    split_checked: str
    report_a: JobReport
    report_b: JobReport
    paired: PairedComparison
    excluded: list[ExcludedTask]
    costs: CostComparison
    decision: Decision
    markdown: str

    def to_json(self) -> dict[str, Any]:
        """What ``forgeflow compare --json`` prints: the paired fields at the top level (the
        ``delta_interval`` with its ``method``, ``source`` and ``n_clusters``), then the runs, the
        split, the reports, the excluded tasks with reasons, the cost ratios and ``promotion``, the
        gate's decision (``verdict``, ``reason``, ...; the shape of the lifecycle summary's)."""
        return {
            "job_a": self.job_a.job_id, "job_b": self.job_b.job_id,
            **self.paired.model_dump(mode="json"),
            "runs": {"a": self.job_a.summary(), "b": self.job_b.summary()},
            "split_checked": self.split_checked,
            "report_a": self.report_a.model_dump(mode="json"), "report_b": self.report_b.model_dump(mode="json"),
            "excluded_tasks": [e.model_dump(mode="json") for e in self.excluded],
            "costs": self.costs.model_dump(mode="json"),
            "promotion": self.decision.model_dump(mode="json"),
        }


def excluded_tasks(trials_a: Iterable[Any], trials_b: Iterable[Any]) -> list[ExcludedTask]:
    """The instances :func:`paired_compare` leaves out, each with its reason: ``no trial in A``,
    ``exception in A: <type>``, ``exception in B: <type>`` or both (sorted by instance id).

    Args:
        trials_a / trials_b: one trial per instance (``instance_id``, ``exception_type``).
    """
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
    """Compare two jobs recorded in a :class:`forgeflow.store.Store` (void trials excluded).

    1. Each job is read as a :class:`MergedJob` (with its recovery jobs unless ``merge_recovery``
       is False); the label always says when recovery jobs are merged.
    2. :func:`refuse_unless_same_frozen_split` checks the jobs table's freeze and split.
    3. :func:`paired_compare` on the rewards (an exception, flagged or not, is excluded and
       listed with its reason), clustered by repository (``task_instances.repo``) when every
       paired instance has a task row, else by instance (said in the report).
    4. :func:`cost_ratios` on the stored trial columns over the paired instances.
    5. :func:`promotion_decision` on both, with ``gate``'s settings.

    Args:
        store: the store.
        job_a: baseline job id.
        job_b: candidate job id.
        merge_recovery: merge each job's recovery jobs (default True).
        n_resamples: bootstrap resamples.
        seed: bootstrap seed.
        confidence: level of the delta interval (default ``1 - gate.alpha``; another level is refused
            by the gate).
        plot_file: image path embedded in the markdown (see :func:`render_plot`).
        gate: the promotion gate's settings (default :class:`~forgeflow.gate.GatePolicy`).

    Raises:
        InputError: a job has no trials (named with the store URL), holds non-agent trials, both ids
            are the same job, the jobs are not on the same frozen split (the difference is named), or
            ``confidence`` differs from ``1 - gate.alpha``.
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
    repo_of: dict[str, str] | None = {}
    for instance_id in paired_ids:
        task = store.get_task(instance_id)
        if task is None:
            repo_of = None
            break
        repo_of[instance_id] = task.repo
    paired = paired_compare(rewards_a, rewards_b, repo_of, n_resamples=n_resamples, seed=seed,
                            confidence=confidence)
    report_a, report_b = JobReport.from_trials(a.trials), JobReport.from_trials(b.trials)
    costs = cost_ratios({t.instance_id: stored_costs(t) for t in a.trials},
                        {t.instance_id: stored_costs(t) for t in b.trials}, paired_ids)
    excluded = excluded_tasks(a.trials, b.trials)
    decision = promotion_decision(paired, gate, costs=costs)
    notes = [f"A = {a.label}", f"B = {b.label}", f"same frozen split: {split_checked}"]
    if repo_of is None and paired_ids:
        notes.append("delta interval clustered by instance: some paired instances have no task_instances row "
                     "(no repository known)")
    if excluded:
        notes.append("excluded from the pairs: " + "; ".join(f"{e.instance_id} ({e.reason})" for e in excluded))
    markdown = render_markdown(report_a, report_b, paired, job_a, job_b, costs=costs, decision=decision,
                               notes=notes, plot_file=plot_file)
    return StoredJobsComparison(job_a=a, job_b=b, split_checked=split_checked, report_a=report_a,
                                report_b=report_b, paired=paired, excluded=excluded, costs=costs,
                                decision=decision, markdown=markdown)


# --- plot ------------------------------------------------------------------------------------------
def render_plot(report_a: JobReport, report_b: JobReport, paired: PairedComparison, path: Any,
                label_a: str = "A", label_b: str = "B") -> Any:
    """Save a PNG: pass rates over scored trials with their Wilson intervals (left) and wins /
    losses per repository (right; one bar pair for all pairs when no repository is known).

    matplotlib's object API with the Agg canvas (no display, thread-safe: no pyplot state). The
    file is written atomically.

    Args:
        report_a / report_b: the runs' job reports (pass rate and Wilson interval).
        paired: the paired comparison (``per_repo``, or the totals).
        path: the PNG path.
        label_a / label_b: run names on the axes.

    Returns:
        The path written (``pathlib.Path``).
    """
    import io
    from pathlib import Path

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from forgeflow.fsutil import atomic_write_bytes

    fig = Figure(figsize=(9, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 2]})
    rates = [report_a.pass_rate_scored, report_b.pass_rate_scored]
    lows = [r - rep.wilson.low for r, rep in zip(rates, (report_a, report_b), strict=True)]
    highs = [rep.wilson.high - r for r, rep in zip(rates, (report_a, report_b), strict=True)]
    left.bar([0, 1], rates, yerr=[lows, highs], capsize=6, color=["#8c8c8c", "#3b7dd8"])
    left.set_xticks([0, 1], [f"{label_a}\n(n={report_a.scored})", f"{label_b}\n(n={report_b.scored})"])
    left.set_ylim(0, 1)
    left.set_ylabel("pass rate (scored trials)")
    left.set_title(f"pass rate, Wilson {100 * report_a.wilson.confidence:g}%")
    groups = paired.per_repo or {"all pairs": PairCounts(n_pairs=paired.n_pairs, wins=paired.wins,
                                                          ties=paired.ties, losses=paired.losses)}
    names = list(groups)
    xs = range(len(names))
    right.bar(xs, [groups[n].wins for n in names], color="#2e9e4f", label=f"wins ({label_b} only passed)")
    right.bar(xs, [-groups[n].losses for n in names], color="#d24b3e", label=f"losses ({label_a} only passed)")
    right.axhline(0, color="black", linewidth=0.8)
    right.set_xticks(list(xs), names, rotation=20, ha="right", fontsize=8)
    right.set_ylabel("pairs")
    right.set_title("wins / losses per repository")
    right.legend(fontsize=7, loc="best")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    out = Path(path)
    atomic_write_bytes(out, buffer.getvalue())
    return out
