"""The promotion gate: may candidate B replace baseline A? promote, hold or reject, and why.

A verdict needs evidence (docs/architecture.md: "a decision needs evidence ... otherwise the answer is
hold"): enough pairs and repositories, and a paired delta interval whose lower bound clears ``-max_drop``
(non-inferiority; Wellek 2010, "Testing Statistical Hypotheses of Equivalence and Noninferiority"); costs
within their ratio limits; no unusable job (:mod:`forgeflow.evaluation.compare.exclusions`)."""

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
    """The promotion gate's parameters."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    max_drop: float = Field(0.05, ge=0.0, le=1.0,
                            description="Largest tolerated drop in pass rate, a fraction in [0, 1] (0.05 = five "
                                        "points).")
    alpha: float = Field(0.05, gt=0.0, le=0.5,
                         description="Significance level in (0, 0.5]; the delta interval is at confidence 1 - "
                                     "alpha.")
    min_pairs: int = Field(30, ge=1,
                           description="Fewest pairs (instances scored in both runs) for any verdict but hold.")
    min_repos: int = Field(3, ge=1, description="Fewest repositories those pairs must come from.")
    max_wall_s_ratio: float | None = Field(
        1.5, gt=0.0,
        description="Largest mean wall seconds per trial, B / A (None: not checked).")
    max_input_tokens_ratio: float | None = Field(
        1.25, gt=0.0,
        description="Largest mean model input tokens per trial, B / A (None: not checked).")
    max_agent_steps_ratio: float | None = Field(
        1.25, gt=0.0,
        description="Largest mean agent steps per trial, B / A (None: not checked).")
    max_exception_rate: float = Field(DEFAULT_MAX_EXCEPTION_RATE, ge=0.0, le=1.0,
                                      description="Largest fraction of a job's requested trials excluded as "
                                                  "exceptions (or missing) for the job to be compared, in [0, 1]")

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
    """One cost ratio against its limit."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(description="wall_s, input_tokens or agent_steps.")
    ratio: float | None = Field(None, description="Mean B / mean A over the pairs that recorded it (None: unknown).")
    max_ratio: float | None = Field(None, description="The limit (None: not checked).")
    status: Literal["ok", "over", "unknown", "not_checked"] = Field(
        description="ok (within), over (beyond: the gate holds), unknown (no data in one run, or A's mean is 0: "
                    "reported, does not block) or not_checked.")

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
        max_drop / alpha / min_pairs / min_repos: The settings used.
    """

    model_config = ConfigDict(frozen=True)

    verdict: Literal["promote", "hold", "reject"] = Field(description="promote, hold or reject.")
    reason: str = Field(
        description="The reasons, joined with \"; \" (the numbers each rule used; \"not enough evidence\" first "
                    "when that is why).")
    enough_evidence: bool = Field(False,
                                  description="False when the pairs, the repositories or the interval fell short.")
    delta: float = Field(description="The paired delta the decision read.")
    interval_low: float | None = Field(None,
                                       description="Lower bound of the reported delta interval (None without "
                                                   "pairs).")
    interval_high: float | None = Field(None, description="Upper bound.")
    interval_method: str | None = Field(None, description="How that interval was made (ConfidenceInterval.method).")
    mcnemar_p: float = Field(description="Exact McNemar p.")
    n_pairs: int = Field(0, ge=0, description="Pairs scored in both runs.")
    n_repos: int | None = Field(None, description="Repositories they come from (None: unknown, no repository map).")
    pairs_needed: int | None = Field(None,
                                     description="Pairs the gate would need at the observed rates (None: enough, or "
                                                 "no number would because the observed delta is itself below "
                                                 "-max_drop).")
    repos_needed: int | None = Field(None, description="Repositories it would need (None: enough).")
    costs: list[CostCheck] = Field(default_factory=list, description="Each cost ratio against its limit.")
    unusable: list[str] = Field(default_factory=list,
                                description="Why a job was not compared (its exclusion rate above "
                                            "max_exception_rate: job, rate and limit named)")
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

    Rule (``[low, high]`` is ``comparison.delta_interval`` at confidence ``1 - alpha``):

    0. **hold, not compared** when a job is ``unusable`` (the reason goes on with what 1-5 would say);
    1. **hold, not enough evidence** below ``min_pairs`` pairs or ``min_repos`` repositories;
    2. **reject** when ``high < -max_drop``, or ``delta < -max_drop`` with exact McNemar ``p < alpha``;
    3. **hold, not enough evidence** when ``low < -max_drop`` (the reason gives the pairs needed,
       :func:`forgeflow.evaluation.paired_stats.pairs_needed`);
    4. **hold** when a cost ratio B / A is beyond its limit (a ratio without data is unknown, never blocks);
    5. **promote** otherwise: B is not worse than A by more than ``max_drop`` (non-inferiority; Wellek 2010).

    Raises:
        InputError: a setting is unknown or out of range, or the interval is not at confidence ``1 - alpha``.
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
