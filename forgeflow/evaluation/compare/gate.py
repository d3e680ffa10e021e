"""The promotion gate: may candidate B replace baseline A? promote, hold or reject, and why.

A verdict needs evidence and weighs cost (docs/architecture.md: "a decision needs evidence ...
otherwise the answer is hold"):

* **evidence** — at least ``min_pairs`` pairs from at least ``min_repos`` repositories, and a
  paired delta interval (:class:`forgeflow.evaluation.paired_stats.DeltaInterval`: Newcombe's hybrid score
  interval united with the repository cluster bootstrap, valid at small n and few clusters) whose
  lower bound clears ``-max_drop`` (non-inferiority with margin ``max_drop``; Wellek 2010, "Testing
  Statistical Hypotheses of Equivalence and Noninferiority"). Short of it the verdict is hold,
  "not enough evidence", with the pairs and repositories that would be needed.
* **cost** — the candidate's mean wall seconds, input tokens and agent steps per paired trial, as
  ratios B / A, within the largest allowed ratios; beyond one, the verdict is hold, naming it.
* **usable jobs** — a job whose trials were excluded as exceptions (or never came back) above
  ``max_exception_rate`` of its requested trials is unusable (:mod:`forgeflow.evaluation.compare.exclusions`):
  the verdict is hold, naming the job, its rate and the limit, whatever the pairs say.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from forgeflow.common.errors import InputError
from forgeflow.evaluation.compare.exclusions import DEFAULT_MAX_EXCEPTION_RATE
from forgeflow.evaluation.compare.stats import CostComparison, PairedComparison
from forgeflow.evaluation.paired_stats import pairs_needed

COST_LIMITS = (("wall_s", "max_wall_s_ratio"), ("input_tokens", "max_input_tokens_ratio"),
               ("agent_steps", "max_agent_steps_ratio"))
"""Cost metric -> the :class:`GatePolicy` field that bounds its ratio B / A."""


class GatePolicy(BaseModel):
    """The promotion gate's parameters.

    The cost defaults: wall time is the noisiest cost (machine load, sandbox concurrency, cold
    image caches: two runs of one model on this machine differ by tens of percent — the demo's
    candidate, the same size as its baseline, took 1.36x the wall time), so it gets the widest
    allowance, 1.5x. Input tokens and agent steps are what serving pays per task and move little
    between runs of one model; a candidate may spend up to 25% more of them. The hand-run
    pipeline's test38 candidate (+47.7% input tokens, 2.33x the runtime) is beyond both; its
    +19.2% agent steps is within.

    Attributes:
        max_drop: Largest tolerated drop in pass rate, a fraction in [0, 1] (0.05 = five points).
        alpha: Significance level in (0, 0.5]; the delta interval is at confidence ``1 - alpha``.
        min_pairs: Fewest pairs (instances scored in both runs) for any verdict but hold.
        min_repos: Fewest repositories those pairs must come from.
        max_wall_s_ratio: Largest mean wall seconds per trial, B / A (None: not checked).
        max_input_tokens_ratio: Largest mean model input tokens per trial, B / A (None: not checked).
        max_agent_steps_ratio: Largest mean agent steps per trial, B / A (None: not checked).
        max_exception_rate: Largest fraction of a job's requested trials excluded as exceptions (or missing)
            for the job to be compared, in [0, 1]; above it the job is unusable and the verdict is hold
            (default 0.2: :data:`forgeflow.evaluation.compare.exclusions.DEFAULT_MAX_EXCEPTION_RATE`, where
            the choice is explained).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    max_drop: float = Field(0.05, ge=0.0, le=1.0)
    alpha: float = Field(0.05, gt=0.0, le=0.5)
    min_pairs: int = Field(30, ge=1)
    min_repos: int = Field(3, ge=1)
    max_wall_s_ratio: float | None = Field(1.5, gt=0.0)
    max_input_tokens_ratio: float | None = Field(1.25, gt=0.0)
    max_agent_steps_ratio: float | None = Field(1.25, gt=0.0)
    max_exception_rate: float = Field(DEFAULT_MAX_EXCEPTION_RATE, ge=0.0, le=1.0)

    @classmethod
    def build(cls, base: GatePolicy | None = None, **settings: Any) -> GatePolicy:
        """``base`` (default: the defaults) with ``settings`` replaced, validated.

        Raises:
            InputError: a setting is unknown or out of range (named).
        """
        try:
            return cls(**{**(base or cls()).model_dump(), **settings})
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
            raise InputError(f"promotion gate settings: {problems}") from None


class CostCheck(BaseModel):
    """One cost ratio against its limit.

    Attributes:
        name: ``wall_s``, ``input_tokens`` or ``agent_steps``.
        ratio: Mean B / mean A over the pairs that recorded it (None: unknown).
        max_ratio: The limit (None: not checked).
        status: ``ok`` (within), ``over`` (beyond: the gate holds), ``unknown`` (no data in one
            run, or A's mean is 0: reported, does not block) or ``not_checked``.
    """

    model_config = ConfigDict(frozen=True)

    name: str
    ratio: float | None = None
    max_ratio: float | None = None
    status: Literal["ok", "over", "unknown", "not_checked"]

    def describe(self) -> str:
        """``wall_s 2.33x > 1.5x`` and the like."""
        if self.status == "unknown":
            return f"{self.name} ratio unknown (not recorded in both runs)"
        if self.status == "not_checked":
            return f"{self.name} {_x(self.ratio)} (not checked)"
        sign = ">" if self.status == "over" else "<="
        return f"{self.name} {_x(self.ratio)} {sign} {self.max_ratio:g}x"


def _x(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.3g}x"


class Decision(BaseModel):
    """The promotion gate's verdict and why.

    Attributes:
        verdict: ``promote``, ``hold`` or ``reject``.
        reason: The reasons, joined with "; " (the numbers each rule used; "not enough evidence"
            first when that is why).
        enough_evidence: False when the pairs, the repositories or the interval fell short.
        delta: The paired delta the decision read.
        interval_low: Lower bound of the reported delta interval (None without pairs).
        interval_high: Upper bound.
        interval_method: How that interval was made (``DeltaInterval.method``).
        mcnemar_p: Exact McNemar p.
        n_pairs: Pairs scored in both runs.
        n_repos: Repositories they come from (None: unknown, no repository map).
        pairs_needed: Pairs the gate would need at the observed rates (None: enough, or no number
            would because the observed delta is itself below ``-max_drop``).
        repos_needed: Repositories it would need (None: enough).
        costs: Each cost ratio against its limit.
        unusable: Why a job was not compared (its exclusion rate above ``max_exception_rate``: job, rate and
            limit named); empty when both jobs were usable.
        max_drop / alpha / min_pairs / min_repos: The settings used.
    """

    model_config = ConfigDict(frozen=True)

    verdict: Literal["promote", "hold", "reject"]
    reason: str
    enough_evidence: bool = False
    delta: float
    interval_low: float | None = None
    interval_high: float | None = None
    interval_method: str | None = None
    mcnemar_p: float
    n_pairs: int = Field(0, ge=0)
    n_repos: int | None = None
    pairs_needed: int | None = None
    repos_needed: int | None = None
    costs: list[CostCheck] = Field(default_factory=list)
    unusable: list[str] = Field(default_factory=list)
    max_drop: float
    alpha: float
    min_pairs: int = 30
    min_repos: int = 3


def check_costs(costs: CostComparison | None, policy: GatePolicy) -> list[CostCheck]:
    """Each cost ratio of ``costs`` against ``policy``'s limits (all ``unknown`` without costs)."""
    checks = []
    for name, field in COST_LIMITS:
        limit = getattr(policy, field)
        ratio = None if costs is None else getattr(costs, name).ratio
        if limit is None:
            status = "not_checked"
        elif ratio is None:
            status = "unknown"
        else:
            status = "over" if ratio > limit else "ok"
        checks.append(CostCheck(name=name, ratio=ratio, max_ratio=limit, status=status))
    return checks


def _pp(value: float) -> str:
    return f"{100 * value:+.1f}"


def promotion_decision(
    comparison: PairedComparison, policy: GatePolicy | None = None, *, costs: CostComparison | None = None,
    unusable: Sequence[str] = (), **settings: Any,
) -> Decision:
    """Decide whether candidate B may replace baseline A.

    Rule (``[low, high]`` is ``comparison.delta_interval``, the union of Newcombe's interval and the
    repository bootstrap, at confidence ``1 - alpha``; ``k`` the repositories of the pairs):

    0. **hold, not compared** when a job is unusable (``unusable`` names why: its trials excluded as
       exceptions above ``max_exception_rate``, :func:`forgeflow.evaluation.compare.exclusions.job_exclusions`);
       the reason starts with it and goes on with what rules 1-5 would have said of the pairs;
    1. **hold, not enough evidence** when fewer than ``min_pairs`` pairs or ``min_repos``
       repositories were scored (repositories unknown count as too few), whatever the interval
       says; the reason adds when the pairs so far already point to a drop;
    2. **reject** when ``high < -max_drop`` (the whole interval lies below the allowed drop), or
       ``delta < -max_drop`` with exact McNemar ``p < alpha`` (a significant drop beyond it);
    3. **hold, not enough evidence** when ``low < -max_drop``: the interval cannot exclude the
       drop; the reason says the pairs Newcombe's bound would need at the observed rates
       (:func:`forgeflow.evaluation.paired_stats.pairs_needed`), and more repositories when only the
       bootstrap reaches below;
    4. **hold** when a cost ratio B / A is beyond its limit (each named; these reasons are added to
       those of 1 and 3 too). A ratio with no data is reported as unknown and does not block;
    5. **promote** otherwise: with confidence ``1 - alpha`` B is not worse than A by more than
       ``max_drop`` (non-inferiority; Wellek 2010), on enough pairs and repositories, at a cost
       within the limits.

    Args:
        comparison: The paired comparison (:func:`forgeflow.evaluation.compare.paired_compare`).
        policy: The gate's settings (default :class:`GatePolicy`).
        costs: Mean costs and their ratios over the pairs (:func:`forgeflow.evaluation.compare.cost_ratios`);
            None: every cost ratio is unknown (said in the reason).
        unusable: Why a job may not be compared (one reason per unusable job); empty: both usable.
        **settings: :class:`GatePolicy` fields that replace ``policy``'s (``max_drop=0.02``).

    Returns:
        :class:`Decision`.

    Raises:
        InputError: a setting is unknown or out of range, or the comparison's interval is not at
            confidence ``1 - alpha`` (recompute it with ``paired_compare(confidence=1 - alpha)``).
    """
    p = GatePolicy.build(policy, **settings)
    decision = _pairs_decision(comparison, p, costs)
    if not unusable:
        return decision
    return decision.model_copy(update={
        "verdict": "hold", "enough_evidence": False, "unusable": list(unusable),
        "reason": f"not compared: {'; '.join(unusable)}; the pairs alone: {decision.verdict} ({decision.reason})"})


def _pairs_decision(comparison: PairedComparison, p: GatePolicy, costs: CostComparison | None) -> Decision:
    """Rules 1-5 of :func:`promotion_decision` (the pairs and the costs; usable jobs assumed)."""
    c = comparison
    ci = c.delta_interval
    n_repos = len(c.per_repo) if c.per_repo else None
    checks = check_costs(costs, p)
    over = [check.describe() for check in checks if check.status == "over"]
    unknown = [check.name for check in checks if check.status == "unknown"]
    over_note = [f"cost over the limit: {', '.join(over)}"] if over else []
    unknown_note = [f"cost ratio unknown (not blocking): {', '.join(unknown)}"] if unknown else []
    cost_notes = over_note + unknown_note
    common: dict[str, Any] = {
        "delta": c.delta, "mcnemar_p": c.mcnemar_p, "max_drop": p.max_drop, "alpha": p.alpha,
        "min_pairs": p.min_pairs, "min_repos": p.min_repos, "n_pairs": c.n_pairs, "n_repos": n_repos,
        "costs": checks,
    }
    margin = f"-{100 * p.max_drop:g} pp"
    if c.n_pairs == 0 or ci is None:
        return Decision(verdict="hold", reason="; ".join([
            f"not enough evidence: no instance was scored in both runs (needs >= {p.min_pairs} pairs from "
            f">= {p.min_repos} repositories)", *cost_notes]),
            pairs_needed=p.min_pairs, repos_needed=p.min_repos, **common)
    if abs(ci.confidence - (1.0 - p.alpha)) > 1e-9:
        raise InputError(
            f"the comparison's delta interval is at confidence {ci.confidence:g} but alpha={p.alpha:g} needs "
            f"{1.0 - p.alpha:g}; recompute it with paired_compare(..., confidence={1.0 - p.alpha:g})"
        )
    common |= {"interval_low": ci.low, "interval_high": ci.high, "interval_method": ci.method}
    repos = "repositories unknown" if n_repos is None else f"{n_repos} repositor{'y' if n_repos == 1 else 'ies'}"
    span = (f"delta {_pp(c.delta)} pp, {100 * ci.confidence:g}% interval [{_pp(ci.low)}, {_pp(ci.high)}] pp "
            f"(Newcombe hybrid score united with the repository bootstrap; {c.n_pairs} pairs, {repos})")
    dropped = ci.high < -p.max_drop or (c.delta < -p.max_drop and c.mcnemar_p < p.alpha)
    drop_reason = (f"the whole interval is below {margin}" if ci.high < -p.max_drop
                   else f"a drop beyond {margin} with McNemar p={c.mcnemar_p:.3g} < {p.alpha:g}")
    need = pairs_needed(c.both_pass, c.wins, c.losses, c.both_fail, p.max_drop, ci.confidence)
    short: list[str] = []
    if c.n_pairs < p.min_pairs:
        short.append(f"{c.n_pairs} pairs < {p.min_pairs}")
    if n_repos is None:
        short.append(f"the pairs' repositories are unknown (needs >= {p.min_repos})")
    elif n_repos < p.min_repos:
        short.append(f"{repos} < {p.min_repos}")
    if short:
        lead = f"not enough evidence: {', '.join(short)}; {span}"
        if dropped:
            lead += f"; the pairs so far point to a drop ({drop_reason})"
        elif ci.low < -p.max_drop:
            lead += f"; the interval cannot exclude {margin}"
        pairs = max(p.min_pairs, need) if need is not None else None
        lead += _needs(pairs, p.min_repos, c.delta, margin)
        return Decision(verdict="hold", reason="; ".join([lead, *cost_notes]), pairs_needed=pairs,
                        repos_needed=p.min_repos if n_repos is None or n_repos < p.min_repos else None, **common)
    if dropped:
        return Decision(verdict="reject", reason="; ".join([f"{span}: {drop_reason}", *cost_notes]),
                        enough_evidence=True, **common)
    if ci.low < -p.max_drop:
        bootstrap_only = ci.newcombe.low >= -p.max_drop
        pairs = None if bootstrap_only or need is None else max(p.min_pairs, need)
        repos_needed = max(p.min_repos, (n_repos or 0) + 1) if bootstrap_only else None
        lead = f"not enough evidence: {span} cannot exclude {margin}"
        if bootstrap_only:
            lead += (f" (Newcombe's bound {_pp(ci.newcombe.low)} pp clears it; the bootstrap over {repos} does "
                     f"not): needs more repositories (> {n_repos})")
        else:
            lead += _needs(pairs, None, c.delta, margin)
        return Decision(verdict="hold", reason="; ".join([lead, *cost_notes]), pairs_needed=pairs,
                        repos_needed=repos_needed, **common)
    if over:
        return Decision(verdict="hold", reason="; ".join([f"{span}: non-inferior, but the cost is over the limit: "
                                                          f"{', '.join(over)}", *unknown_note]),
                        enough_evidence=True, **common)
    return Decision(verdict="promote", reason="; ".join([f"{span}: not worse than {margin} (non-inferior)",
                                                         *cost_notes]), enough_evidence=True, **common)


def _needs(pairs: int | None, min_repos: int | None, delta: float, margin: str) -> str:
    """``; would need about N pairs (at the observed rates) from >= R repositories``."""
    repos = f" from >= {min_repos} repositories" if min_repos is not None else ""
    if pairs is None:
        return (f"; no number of pairs would clear {margin} at the observed rates (delta {_pp(delta)} pp)"
                + (f"; needs >= {min_repos} repositories" if min_repos is not None else ""))
    return f"; would need about {pairs} pairs at the observed rates{repos}"
