"""The statistics of one job and of two paired jobs: pass rates with Wilson intervals
(:func:`wilson_interval`, :class:`JobReport`), the paired comparison with exact McNemar and the
delta interval (:func:`paired_compare`), and the cost ratios of two jobs (:func:`cost_ratios`).
Sources are named in the package docstring (:mod:`forgeflow.evaluation.compare`)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common.errors import SCORED_DESPITE_EXCEPTION, InputError
from forgeflow.evaluation.paired_stats import (
    WILSON_METHOD,
    ConfidenceInterval,
    cluster_bootstrap_delta,
    newcombe_paired_interval,
    normal_quantile,
    union_interval,
    wilson_limits,
)

PASS_REWARD = 1.0
"""A scored trial passes when ``reward >= PASS_REWARD``."""


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> ConfidenceInterval:
    """Wilson score interval for ``successes`` out of ``n`` (method :data:`~forgeflow.evaluation.paired_stats.
    WILSON_METHOD`, both ends in [0, 1]; ``[0, 1]`` when ``n == 0``).

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
        return ConfidenceInterval(method=WILSON_METHOD, low=0.0, high=1.0, confidence=confidence)
    low, high = wilson_limits(successes, n, normal_quantile(confidence))
    return ConfidenceInterval(method=WILSON_METHOD, low=low, high=high, confidence=confidence)


def mcnemar_exact_p(wins: int, losses: int) -> float:
    """Two-sided exact McNemar p-value on the discordant pairs (McNemar 1947): the binomial test of
    ``min(wins, losses)`` out of ``wins + losses`` at p = 0.5, doubled and capped at 1; 1.0 with no discordant
    pair. Integer arithmetic (``math.comb``), exact at any count; the same value as statsmodels'
    ``mcnemar(table, exact=True)`` (tests/core/evaluation/test_compare_stats_exact.py), without its ~1-3 s
    import on every ``forgeflow compare``.

    Raises:
        InputError: a negative count.
    """
    if wins < 0 or losses < 0:
        raise InputError(f"mcnemar_exact_p needs counts >= 0, got wins={wins}, losses={losses}")
    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(wins, losses) + 1))
    return min(1.0, 2 * tail / 2 ** n)


class TrialOutcome(Protocol):
    """What a report reads from a trial (``forgeflow.ledger.store.TrialRecord`` fits)."""

    instance_id: str
    reward: float | None
    exception_type: str | None


def _passed(reward: float) -> bool:
    return reward >= PASS_REWARD


class JobReport(BaseModel):
    """The outcome counts of one evaluation job."""

    model_config = ConfigDict(frozen=True)

    requested: int = Field(ge=0, description="Trials the job asked for (>= the trials that came back).")
    scored: int = Field(ge=0, description="Trials with a reward (no exception).")
    exceptions_by_type: dict[str, int] = Field(description="Exception class name -> count.")
    missing: int = Field(ge=0, description="Requested trials that produced no record at all.")
    reward_1: int = Field(ge=0, description="Scored trials that passed (reward >= 1.0).")
    reward_0: int = Field(ge=0, description="Scored trials that did not pass.")
    pass_rate_scored: float = Field(ge=0.0, le=1.0, description="reward_1 / scored (0 when nothing was scored).")
    pass_rate_attempts: float = Field(ge=0.0, le=1.0,
                                      description="reward_1 / requested (exceptions and missing count as not "
                                                  "passed).")
    wilson: ConfidenceInterval = Field(description="Wilson interval of reward_1 out of scored.")
    flagged: int = Field(default=0, ge=0,
                         description="Exception trials that still carry the verifier's reward (agent timeout, dead "
                                     "loop, hang: forgeflow.common.errors.SCORED_DESPITE_EXCEPTION, Harbor's "
                                     "convention). They are counted under their exception type and are *not* in "
                                     "scored or the pass rates (the run was cut short by the harness).")
    flagged_reward_1: int = Field(default=0, ge=0, description="Of those, how many the verifier passed anyway.")

    @property
    def exceptions(self) -> int:
        """Total trials that ended in an exception."""
        return sum(self.exceptions_by_type.values())

    @classmethod
    def from_trials(
        cls, trials: Iterable[TrialOutcome], requested: int | None = None, confidence: float = 0.95
    ) -> JobReport:
        """Count a job's trials (``requested`` defaults to the number given).

        Raises:
            InputError: a trial with neither reward nor exception type, or both (allowed only for
                :data:`~forgeflow.common.errors.SCORED_DESPITE_EXCEPTION`), or ``requested`` below the trials.
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
    """Run B against baseline run A on the instances both scored."""

    model_config = ConfigDict(frozen=True)

    n_pairs: int = Field(ge=0, description="Instances scored in both runs.")
    wins: int = Field(ge=0, description="Pairs where B passed and A did not.")
    ties: int = Field(ge=0, description="Pairs with the same outcome (both_pass + both_fail).")
    losses: int = Field(ge=0, description="Pairs where A passed and B did not.")
    both_pass: int = Field(ge=0, description="Pairs where both passed.")
    both_fail: int = Field(ge=0, description="Pairs where neither passed.")
    pass_rate_a: float = Field(ge=0.0, le=1.0, description="A's pass rate over the pairs.")
    pass_rate_b: float = Field(ge=0.0, le=1.0, description="B's pass rate over the pairs.")
    delta: float = Field(ge=-1.0, le=1.0, description="pass_rate_b - pass_rate_a (= (wins - losses) / n_pairs).")
    mcnemar_p: float = Field(ge=0.0, le=1.0,
                             description="Two-sided exact McNemar p-value (1.0 with no discordant pairs).")
    excluded_exception: list[str] = Field(
        description="Instances left out because either run had an exception (sorted).")
    excluded_missing: list[str] = Field(description="Instances present in only one run (sorted).")
    per_repo: dict[str, PairCounts] = Field(
        default_factory=dict,
        description="Repository -> pair counts (only when repo_of was given).")
    delta_interval: ConfidenceInterval | None = Field(
        None,
        description="The reported interval on delta: Newcombe's paired interval united with the cluster bootstrap "
                    "(by repository when repo_of was given, else by instance); each alone in .newcombe / .bootstrap "
                    "(None when there are no pairs).")


def paired_compare(
    a: Mapping[str, float | None],
    b: Mapping[str, float | None],
    repo_of: Mapping[str, str] | None = None,
    *,
    n_resamples: int = 2000,
    seed: int = 0,
    confidence: float = 0.95,
) -> PairedComparison:
    """Compare run B with baseline run A instance by instance (a reward None: the trial ended in an exception).

    Returns:
        Counts, pass rates over the pairs, McNemar's exact p on ``[[both_pass, losses], [wins, both_fail]]``
        (rows A pass/fail, columns B pass/fail) and the union delta interval.

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
        p_value = mcnemar_exact_p(wins, losses)

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


# --- cost ratios ---------------------------------------------------------------------------------
COST_METRICS = ("input_tokens", "agent_steps", "wall_s")
"""Keys read from the per-trial cost dicts: model input tokens, agent steps, wall seconds."""


class CostMetric(BaseModel):
    """One cost metric of both runs over the same instances."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(description="input_tokens, agent_steps or wall_s.")
    n: int = Field(ge=0, description="Instances where both runs recorded the metric (the means are over these).")
    mean_a: float | None = Field(default=None, ge=0.0, description="Mean in run A (None when n == 0).")
    mean_b: float | None = Field(default=None, ge=0.0, description="Mean in run B.")
    ratio: float | None = Field(default=None, ge=0.0,
                                description="mean_b / mean_a (None when either is missing or mean_a == 0).")


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

    Args:
        costs_a: Instance id -> ``{"input_tokens": .., "agent_steps": .., "wall_s": ..}`` (keys may be missing).
        instance_ids: Instances to include (default: those in both mappings).

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


def rewards_by_instance(trials: Iterable[Any]) -> dict[str, float | None]:
    """``instance_id -> reward`` for :func:`paired_compare`; a trial that ended in an exception maps
    to None (excluded from the pairs and counted), never to reward 0."""
    return {t.instance_id: t.reward if t.exception_type is None else None for t in trials}
