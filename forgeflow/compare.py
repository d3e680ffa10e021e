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
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field
from statsmodels.stats.contingency_tables import mcnemar
from statsmodels.stats.proportion import proportion_confint

from forgeflow.errors import InputError

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
            InputError: a trial has both or neither of reward and exception type, or
                ``requested`` is smaller than the number of trials.
        """
        rows = list(trials)
        total = len(rows) if requested is None else requested
        if total < len(rows):
            raise InputError(f"requested={total} is smaller than the {len(rows)} trials given")
        exceptions: Counter[str] = Counter()
        passed = failed = 0
        for trial in rows:
            if (trial.reward is None) == (trial.exception_type is None):
                raise InputError(
                    f"trial for {trial.instance_id!r} must have exactly one of reward "
                    f"({trial.reward!r}) and exception_type ({trial.exception_type!r})"
                )
            if trial.exception_type is not None:
                exceptions[trial.exception_type] += 1
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


def paired_compare(
    a: Mapping[str, float | None],
    b: Mapping[str, float | None],
    repo_of: Mapping[str, str] | None = None,
) -> PairedComparison:
    """Compare run B with baseline run A instance by instance.

    Args:
        a: Instance id -> reward in run A; None means the trial ended in an exception.
        b: Instance id -> reward in run B; None likewise.
        repo_of: Instance id -> repository, for the per-repository breakdown (optional; must
            cover every paired instance).

    Returns:
        Counts, pass rates over the pairs, and McNemar's exact p-value on the 2x2 table
        ``[[both_pass, losses], [wins, both_fail]]`` (rows A pass/fail, columns B pass/fail).

    Raises:
        InputError: ``repo_of`` lacks a paired instance.
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
    )


def _pct(value: float) -> str:
    return f"{100.0 * value:.1f}%"


def render_markdown(
    report_a: JobReport,
    report_b: JobReport,
    comparison: PairedComparison,
    label_a: str = "A",
    label_b: str = "B",
) -> str:
    """A Markdown summary a person reads: per-run counts side by side, then the paired result.

    Returns:
        Markdown text (two tables, a verdict line and, if present, a per-repository table).
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
    lines = [f"## {label_b} vs {label_a}", "", f"| | {label_a} | {label_b} |", "|---|---:|---:|"]
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
    if c.per_repo:
        lines += ["", "| repository | pairs | wins | ties | losses |", "|---|---:|---:|---:|---:|"]
        lines += [
            f"| {repo} | {pc.n_pairs} | {pc.wins} | {pc.ties} | {pc.losses} |"
            for repo, pc in c.per_repo.items()
        ]
    return "\n".join(lines) + "\n"
