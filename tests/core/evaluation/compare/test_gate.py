"""The promotion gate on the tables a user would check: the hand-run pipeline's test38 and
Verified27, the demo's six both-fail pairs, and a clearly better and a clearly worse candidate."""

from __future__ import annotations

import pytest

from forgeflow.common.errors import InputError
from forgeflow.evaluation.compare import (
    CostComparison,
    PairedComparison,
    cost_ratios,
    paired_compare,
)
from forgeflow.evaluation.compare.gate import GatePolicy, promotion_decision


def table(both_pass: int, wins: int, losses: int, both_fail: int, n_repos: int) -> PairedComparison:
    """A paired comparison with these counts, the instances dealt round-robin over ``n_repos``."""
    outcomes = ([(1.0, 1.0)] * both_pass + [(0.0, 1.0)] * wins + [(1.0, 0.0)] * losses
                + [(0.0, 0.0)] * both_fail)
    a = {f"t{k:03d}": ra for k, (ra, _) in enumerate(outcomes)}
    b = {f"t{k:03d}": rb for k, (_, rb) in enumerate(outcomes)}
    return paired_compare(a, b, {i: f"repo{k % n_repos}" for k, i in enumerate(sorted(a))})


def costs(comparison: PairedComparison, wall_s: tuple[float, float], input_tokens: tuple[float, float],
          agent_steps: tuple[float, float]) -> CostComparison:
    """Every paired instance with the same (baseline, candidate) costs."""
    ids = [f"t{k:03d}" for k in range(comparison.n_pairs)]
    base, cand = ({"wall_s": wall_s[r], "input_tokens": input_tokens[r], "agent_steps": agent_steps[r]}
                  for r in (0, 1))
    return cost_ratios({i: base for i in ids}, {i: cand for i in ids})


# The hand-run pipeline's test38 candidate: +47.7% input tokens, +19.2% agent steps, 2.33x the runtime.
TEST38_COSTS = {"wall_s": (100.0, 233.0), "input_tokens": (10_000.0, 14_770.0), "agent_steps": (26.0, 31.0)}


@pytest.mark.parametrize("both_pass", [0, 8, 16, 24, 32])
def test_test38_holds_for_lack_of_evidence_and_names_the_cost_ratios(both_pass: int) -> None:
    """3 wins / 32 ties / 3 losses on 38 tasks (the table gives only the ties, so every split of
    them into both-pass / both-fail is checked), over 6 repositories: delta 0, exact McNemar p = 1.0,
    and an interval that cannot exclude a 5-point drop; the cost ratios are over the limits too."""
    comparison = table(both_pass, 3, 3, 32 - both_pass, n_repos=6)
    assert (comparison.n_pairs, comparison.wins, comparison.ties, comparison.losses) == (38, 3, 32, 3)
    assert comparison.delta == 0.0 and comparison.mcnemar_p == 1.0
    cost = costs(comparison, **TEST38_COSTS)
    assert (round(cost.input_tokens.ratio, 3), round(cost.agent_steps.ratio, 3), round(cost.wall_s.ratio, 2)) == (
        1.477, 1.192, 2.33)
    decision = promotion_decision(comparison, costs=cost)
    assert decision.verdict == "hold" and not decision.enough_evidence
    assert decision.interval_low < -0.05 < 0.05 < decision.interval_high
    assert decision.reason.startswith("not enough evidence: delta +0.0 pp, 95% interval [")
    assert "cannot exclude -5 pp; would need about" in decision.reason
    assert decision.pairs_needed > 200 and decision.repos_needed is None
    assert "cost over the limit: wall_s 2.33x > 1.5x, input_tokens 1.48x > 1.25x" in decision.reason
    assert {c.name: c.status for c in decision.costs} == {"wall_s": "over", "input_tokens": "over",
                                                          "agent_steps": "ok"}


def test_test38_figures_with_the_ties_split_evenly() -> None:
    decision = promotion_decision(table(16, 3, 3, 16, n_repos=6), costs=None)
    assert (round(100 * decision.interval_low, 1), round(100 * decision.interval_high, 1)) == (-13.0, 13.0)
    assert decision.pairs_needed == 246 and decision.n_repos == 6
    assert "cost ratio unknown (not blocking): wall_s, input_tokens, agent_steps" in decision.reason


def test_verified27_gives_p_one_and_holds() -> None:
    """2 wins / 23 ties / 2 losses: p = 1.0, 27 pairs are fewer than 30, and the interval is wide."""
    comparison = table(12, 2, 2, 11, n_repos=5)
    assert comparison.mcnemar_p == 1.0 and comparison.delta == 0.0
    decision = promotion_decision(comparison)
    assert decision.verdict == "hold"
    assert decision.reason.startswith("not enough evidence: 27 pairs < 30; delta +0.0 pp")
    assert "the interval cannot exclude -5 pp; would need about" in decision.reason
    assert decision.pairs_needed > 27


def test_the_demo_six_both_fail_pairs_hold_with_a_wide_interval_and_say_what_they_need() -> None:
    """What a fresh machine's demo gets: two tiny models, both 0 on 6 tasks from 2 repositories; the
    candidate took 1.36x the baseline's wall time (within 1.5x)."""
    comparison = table(0, 0, 0, 6, n_repos=2)
    ci = comparison.delta_interval
    assert (ci.bootstrap.low, ci.bootstrap.high) == (0.0, 0.0)  # what the gate used to read
    decision = promotion_decision(comparison, costs=costs(comparison, (10.0, 13.6), (500.0, 500.0), (3.0, 3.0)))
    assert decision.verdict == "hold" and not decision.enough_evidence
    assert (round(100 * decision.interval_low, 1), round(100 * decision.interval_high, 1)) == (-39.0, 39.0)
    assert decision.reason.startswith("not enough evidence: 6 pairs < 30, 2 repositories < 3; delta +0.0 pp, "
                                      "95% interval [-39.0, +39.0] pp")
    assert "would need about 73 pairs at the observed rates from >= 3 repositories" in decision.reason
    assert (decision.pairs_needed, decision.repos_needed, decision.n_repos) == (73, 3, 2)
    assert "cost" not in decision.reason  # 1.36x wall time is within 1.5x
    assert decision.interval_method == "union(newcombe_hybrid_score, cluster_bootstrap)"


def test_a_clearly_better_candidate_with_enough_pairs_and_repositories_promotes() -> None:
    comparison = table(25, 20, 0, 15, n_repos=5)
    decision = promotion_decision(comparison, costs=costs(comparison, (10.0, 11.0), (1000.0, 1100.0), (5.0, 5.0)))
    assert decision.verdict == "promote" and decision.enough_evidence
    assert decision.interval_low > 0.0 and decision.delta == pytest.approx(1 / 3)
    assert "not worse than -5 pp (non-inferior)" in decision.reason
    assert (decision.pairs_needed, decision.repos_needed) == (None, None)
    # the same table at 2x the wall time holds, naming the ratio
    slow = promotion_decision(comparison, costs=costs(comparison, (10.0, 20.0), (1000.0, 1000.0), (5.0, 5.0)))
    assert slow.verdict == "hold" and slow.enough_evidence
    assert "non-inferior, but the cost is over the limit: wall_s 2x > 1.5x" in slow.reason
    # a limit set to None is not checked
    assert promotion_decision(comparison, costs=costs(comparison, (10.0, 20.0), (1000.0, 1000.0), (5.0, 5.0)),
                              max_wall_s_ratio=None).verdict == "promote"


def test_a_clearly_worse_candidate_rejects() -> None:
    decision = promotion_decision(table(20, 0, 25, 15, n_repos=5))
    assert decision.verdict == "reject" and decision.enough_evidence
    assert decision.interval_high < -0.05 and decision.mcnemar_p < 1e-6
    assert "the whole interval is below -5 pp" in decision.reason


def test_a_bootstrap_over_few_repositories_that_reaches_below_asks_for_repositories() -> None:
    """Repository x holds all 8 losses, y and z 10 wins each: Newcombe's bound clears -5 pp, but
    resampling x three times (p = 1/27 > 2.5%) puts the bootstrap's low at -40 pp."""
    outcomes = {f"x.{k}": (1.0, 0.0) if k < 8 else (0.0, 0.0) for k in range(20)}
    outcomes |= {f"{r}.{k}": (0.0, 1.0) if k < 10 else (1.0, 1.0) for r in "yz" for k in range(20)}
    comparison = paired_compare({i: o[0] for i, o in outcomes.items()}, {i: o[1] for i, o in outcomes.items()},
                                {i: i[0] for i in outcomes})
    assert comparison.delta_interval.newcombe.low >= -0.05 > comparison.delta_interval.bootstrap.low
    decision = promotion_decision(comparison)
    assert decision.verdict == "hold" and decision.repos_needed == 4 and decision.pairs_needed is None
    assert "the bootstrap over 3 repositories does not): needs more repositories (> 3)" in decision.reason


def test_gate_settings_are_checked_and_named() -> None:
    with pytest.raises(InputError, match="min_pairs"):
        GatePolicy.build(min_pairs=0)
    with pytest.raises(InputError, match="max_wal_s_ratio"):
        promotion_decision(table(1, 0, 0, 1, n_repos=1), max_wal_s_ratio=2.0)
    policy = GatePolicy.build(GatePolicy(min_pairs=5), max_drop=0.1)
    assert (policy.min_pairs, policy.max_drop, policy.min_repos) == (5, 0.1, 3)
