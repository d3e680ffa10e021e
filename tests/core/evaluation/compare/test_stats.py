"""Job reports and paired comparisons, on cases small enough to check by hand."""

from __future__ import annotations

import math

import pytest

from forgeflow.common.errors import InputError
from forgeflow.evaluation.compare import (
    JobReport,
    cost_ratios,
    paired_compare,
    refuse_unless_same_split,
    render_markdown,
    wilson_interval,
)
from forgeflow.evaluation.compare.gate import promotion_decision
from forgeflow.evaluation.paired_stats import cluster_bootstrap_delta
from forgeflow.ledger.records import TrialRecord


def wilson_by_hand(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return centre - half, centre + half


def trial(instance_id: str, reward: float | None = None, exc: str | None = None) -> TrialRecord:
    return TrialRecord(
        trial_id=f"t-{instance_id}",
        instance_id=instance_id,
        kind="agent",
        reward=reward,
        exception_type=exc,
    )


@pytest.mark.parametrize(("k", "n"), [(3, 10), (0, 10), (10, 10), (7, 40)])
def test_wilson_interval_matches_the_formula(k: int, n: int) -> None:
    interval = wilson_interval(k, n)
    low, high = wilson_by_hand(k, n)
    assert interval.low == pytest.approx(max(0.0, low), abs=1e-9)
    assert interval.high == pytest.approx(min(1.0, high), abs=1e-9)
    assert interval.low <= k / n <= interval.high


def test_wilson_interval_edge_cases() -> None:
    assert wilson_interval(0, 0) == wilson_interval(0, 0, 0.95)
    assert (wilson_interval(0, 0).low, wilson_interval(0, 0).high) == (0.0, 1.0)
    assert wilson_interval(3, 10, 0.99).high > wilson_interval(3, 10, 0.95).high
    with pytest.raises(InputError, match="successes"):
        wilson_interval(11, 10)


def test_job_report_keeps_exceptions_apart_from_failures() -> None:
    trials = [
        trial("i1", 1.0),
        trial("i2", 1.0),
        trial("i3", 0.0),
        trial("i4", exc="SandboxOOMError"),
        trial("i5", exc="SandboxOOMError"),
        trial("i6", exc="ModelEndpointError"),
    ]
    report = JobReport.from_trials(trials, requested=8)
    assert report.requested == 8 and report.scored == 3 and report.missing == 2
    assert report.exceptions_by_type == {"ModelEndpointError": 1, "SandboxOOMError": 2}
    assert (report.reward_1, report.reward_0) == (2, 1)
    assert report.pass_rate_scored == pytest.approx(2 / 3)
    assert report.pass_rate_attempts == pytest.approx(2 / 8)
    assert report.wilson == wilson_interval(2, 3)


def test_job_report_rejects_a_trial_with_neither_reward_nor_exception() -> None:
    broken = TrialRecord.model_construct(
        trial_id="t", instance_id="i", kind="agent", reward=None, exception_type=None
    )
    with pytest.raises(InputError, match="exactly one of reward"):
        JobReport.from_trials([broken])
    with pytest.raises(InputError, match="requested=1"):
        JobReport.from_trials([trial("a", 1.0), trial("b", 0.0)], requested=1)


def test_three_wins_no_losses_gives_exact_mcnemar_p_of_one_quarter() -> None:
    a = {"i1": 0.0, "i2": 0.0, "i3": 0.0, "i4": 1.0, "i5": 0.0}
    b = {"i1": 1.0, "i2": 1.0, "i3": 1.0, "i4": 1.0, "i5": 0.0}
    c = paired_compare(a, b)
    assert (c.n_pairs, c.wins, c.ties, c.losses) == (5, 3, 2, 0)
    assert (c.both_pass, c.both_fail) == (1, 1)
    # Two-sided binomial test on 3 discordant pairs all one way: 2 * 0.5**3.
    assert c.mcnemar_p == pytest.approx(0.25)
    assert c.pass_rate_a == pytest.approx(0.2) and c.pass_rate_b == pytest.approx(0.8)
    assert c.delta == pytest.approx(0.6)


def test_mcnemar_uses_only_discordant_pairs() -> None:
    # 6 wins, 1 loss: p = 2 * P(X <= 1 | n=7, p=0.5) = 2 * 8 / 128 = 0.125.
    a = {f"w{i}": 0.0 for i in range(6)} | {"l": 1.0} | {f"t{i}": 1.0 for i in range(20)}
    b = {f"w{i}": 1.0 for i in range(6)} | {"l": 0.0} | {f"t{i}": 1.0 for i in range(20)}
    c = paired_compare(a, b)
    assert (c.wins, c.losses, c.ties) == (6, 1, 20)
    assert c.mcnemar_p == pytest.approx(0.125)


def test_no_discordant_pairs_gives_p_of_one() -> None:
    c = paired_compare({"i1": 1.0, "i2": 0.0}, {"i1": 1.0, "i2": 0.0})
    assert (c.wins, c.losses, c.ties, c.mcnemar_p, c.delta) == (0, 0, 2, 1.0, 0.0)


def test_exceptions_and_missing_instances_are_excluded_and_listed() -> None:
    a = {"i1": 1.0, "i2": None, "i3": 0.0, "only_a": 1.0}
    b = {"i1": 0.0, "i2": 1.0, "i3": None, "only_b": 0.0}
    c = paired_compare(a, b)
    assert c.n_pairs == 1 and c.losses == 1
    assert c.excluded_exception == ["i2", "i3"]
    assert c.excluded_missing == ["only_a", "only_b"]


def test_per_repo_breakdown_and_missing_repo_is_named() -> None:
    a = {"x.1": 0.0, "x.2": 1.0, "y.1": 1.0}
    b = {"x.1": 1.0, "x.2": 1.0, "y.1": 0.0}
    c = paired_compare(a, b, repo_of={"x.1": "o/x", "x.2": "o/x", "y.1": "o/y"})
    assert c.per_repo["o/x"].wins == 1 and c.per_repo["o/x"].ties == 1
    assert c.per_repo["o/y"].losses == 1
    with pytest.raises(InputError, match=r"y\.1"):
        paired_compare(a, b, repo_of={"x.1": "o/x", "x.2": "o/x"})


def test_markdown_report_shows_both_runs_and_the_paired_verdict() -> None:
    report_a = JobReport.from_trials(
        [trial("i1", 0.0), trial("i2", 1.0), trial("i3", exc="SandboxOOMError")]
    )
    report_b = JobReport.from_trials([trial("i1", 1.0), trial("i2", 1.0), trial("i3", 1.0)])
    comparison = paired_compare(
        {"i1": 0.0, "i2": 1.0, "i3": None}, {"i1": 1.0, "i2": 1.0, "i3": 1.0}
    )
    text = render_markdown(report_a, report_b, comparison, "base", "burst-3")
    assert "| | base | burst-3 |" in text
    assert "| passed (reward 1) | 1 | 3 |" in text
    assert "| exception: SandboxOOMError | 1 | 0 |" in text
    assert "| pass rate (scored) | 50.0% | 100.0% |" in text
    assert "| 2 | 1 | 1 | 0 | 50.0% | 100.0% | +50.0 pp | 1 |" in text
    assert "1 with an exception in either run" in text


# --- clustered interval, costs, same split, promotion gate --------------------------------------
def three_repos() -> tuple[dict[str, float], dict[str, float], dict[str, str]]:
    """Repo x: 3 wins; repos y and z: 3 ties each (delta = 3/9)."""
    ids = [f"{r}.{k}" for r in "xyz" for k in range(3)]
    a = {i: 0.0 if i.startswith(("x", "y")) else 1.0 for i in ids}
    b = {i: 1.0 if i.startswith(("x", "z")) else 0.0 for i in ids}
    return a, b, {i: f"o/{i[0]}" for i in ids}


def test_cluster_bootstrap_resamples_whole_repositories() -> None:
    a, b, repo_of = three_repos()
    reported = paired_compare(a, b, repo_of=repo_of, seed=7).delta_interval
    assert reported is not None and reported.delta == pytest.approx(1 / 3)
    assert (reported.clustered_by, reported.n_clusters, reported.n_pairs) == ("repository", 3, 9)
    clustered = reported.bootstrap
    # A resample draws 3 repositories: P(no x) = (2/3)**3 = 30% -> low is exactly 0;
    # P(x, x, x) = 1/27 = 3.7% > 2.5% -> high is exactly 1.
    assert (clustered.low, clustered.high) == (0.0, 1.0)
    # the reported interval is the union with Newcombe's (3 wins, 3 + 3 ties): its low is Newcombe's
    assert reported.low == reported.newcombe.low < 0.0 and reported.high == 1.0
    assert (reported.low_from, reported.high_from) == ("newcombe", "bootstrap")
    # Per instance, P(>= 7 wins of 9 draws, p = 1/3) = 163/3**9 = 0.8% < 2.5%: high stays below 7/9.
    plain = paired_compare(a, b, seed=7).delta_interval
    assert plain is not None and plain.clustered_by == "instance" and plain.n_clusters == 9
    assert 0.0 <= plain.bootstrap.low and plain.bootstrap.high < 7 / 9
    assert paired_compare(a, b, repo_of=repo_of, seed=7).delta_interval == reported  # seeded


def test_cluster_bootstrap_degenerate_cases() -> None:
    one_repo = cluster_bootstrap_delta({"i1": (False, True), "i2": (True, True)}, {"i1": "r", "i2": "r"})
    assert (one_repo.low, one_repo.delta, one_repo.high) == (0.5, 0.5, 0.5)
    ties = cluster_bootstrap_delta({f"i{k}": (True, True) for k in range(5)}, n_resamples=100, seed=3)
    assert (ties.low, ties.high, ties.n_resamples, ties.seed) == (0.0, 0.0, 100, 3)
    with pytest.raises(InputError, match="n_resamples"):
        cluster_bootstrap_delta({"i": (True, True)}, n_resamples=10)
    with pytest.raises(InputError, match="no repository"):
        cluster_bootstrap_delta({"i": (True, True)}, {})
    assert paired_compare({"i": None}, {"i": 1.0}).delta_interval is None


def test_cost_ratios_over_instances_both_runs_recorded() -> None:
    costs_a = {
        "i1": {"input_tokens": 100, "agent_steps": 10, "wall_s": 20.0},
        "i2": {"input_tokens": 300, "agent_steps": 30},
    }
    costs_b = {
        "i1": {"input_tokens": 50, "agent_steps": 5, "wall_s": 30.0},
        "i2": {"input_tokens": 150, "agent_steps": 15, "wall_s": 99.0},
        "i3": {"input_tokens": 10_000, "agent_steps": 100, "wall_s": 500.0},
    }
    costs = cost_ratios(costs_a, costs_b)
    assert (costs.input_tokens.mean_a, costs.input_tokens.mean_b, costs.input_tokens.ratio) == (200.0, 100.0, 0.5)
    assert costs.agent_steps.ratio == 0.5 and costs.agent_steps.n == 2
    assert (costs.wall_s.n, costs.wall_s.ratio) == (1, 1.5)  # i2 has no wall time in A
    only_i2 = cost_ratios(costs_a, costs_b, instance_ids=["i2"])
    assert only_i2.wall_s.n == 0 and only_i2.wall_s.ratio is None and only_i2.input_tokens.ratio == 0.5
    with pytest.raises(InputError, match="'wall_s' of 'i1'"):
        cost_ratios({"i1": {"wall_s": -1.0}}, {"i1": {"wall_s": 1.0}})


def test_refuses_runs_on_different_splits() -> None:
    assert refuse_unless_same_split(["b", "a"], ["a", "b"], "f" * 64, "f" * 64) == ["a", "b"]
    with pytest.raises(InputError, match=r"1 instances only in base \['c'\], 0 only in cand"):
        refuse_unless_same_split(["a", "b", "c"], ["a", "b"], label_a="base", label_b="cand")
    with pytest.raises(InputError, match="different freezes: A on 111111111111, B on 222222222222"):
        refuse_unless_same_split(["a"], ["a"], "1" * 64, "2" * 64)
    with pytest.raises(InputError, match="only run B names its freeze digest"):
        refuse_unless_same_split(["a"], ["a"], None, "2" * 64)


def own_repo_pairs(outcomes: list[tuple[float, float]]) -> tuple[dict[str, float], dict[str, float], dict[str, str]]:
    a = {f"i{k}": ra for k, (ra, _) in enumerate(outcomes)}
    b = {f"i{k}": rb for k, (_, rb) in enumerate(outcomes)}
    return a, b, {i: f"repo{i}" for i in a}


def test_promotion_gate_holds_without_the_evidence_it_used_to_promote_on() -> None:
    """20 ties, each its own repository: the bootstrap alone said [+0.0, +0.0] and the gate promoted
    even at max_drop 0; Newcombe's interval is +-9.0 pp, 20 pairs are fewer than 30 and the
    repositories are unknown (no repository map), so it holds."""
    ties = paired_compare(*own_repo_pairs([(1.0, 1.0)] * 10 + [(0.0, 0.0)] * 10)[:2])
    assert (ties.delta_interval.bootstrap.low, ties.delta_interval.bootstrap.high) == (0.0, 0.0)
    decision = promotion_decision(ties, max_drop=0.0, alpha=0.05)
    assert decision.verdict == "hold" and not decision.enough_evidence
    assert decision.interval_low == pytest.approx(-0.0898, abs=5e-4) and decision.interval_high == -decision.interval_low
    assert decision.reason.startswith("not enough evidence: 20 pairs < 30, the pairs' repositories are unknown")
    # a collapse on 20 pairs is still a hold (fewer than min_pairs), and the reason says it points to a drop
    collapse = promotion_decision(paired_compare(*own_repo_pairs([(1.0, 0.0)] * 20)[:2]), max_drop=0.05, alpha=0.05)
    assert collapse.verdict == "hold" and "the pairs so far point to a drop (the whole interval is below" in collapse.reason
    assert "no number of pairs would clear -5 pp" in collapse.reason and collapse.pairs_needed is None

    empty = promotion_decision(paired_compare({}, {}), max_drop=0.05, alpha=0.05)
    assert empty.verdict == "hold" and empty.reason.startswith("not enough evidence: no instance was scored")
    assert (empty.pairs_needed, empty.repos_needed) == (30, 3)
    with pytest.raises(InputError, match="confidence=0.9"):
        promotion_decision(ties, max_drop=0.05, alpha=0.1)
    with pytest.raises(InputError, match="max_drop"):
        promotion_decision(ties, max_drop=1.5, alpha=0.05)


def test_promotion_gate_rejects_a_significant_drop_beyond_the_allowance() -> None:
    # 40 pairs over 4 repositories: 10 losses, 0 wins, 30 ties: McNemar p = 2 * 0.5**10; delta -25 pp
    outcomes = [(1.0, 0.0)] * 10 + [(1.0, 1.0)] * 30
    a = {f"i{k}": ra for k, (ra, _) in enumerate(outcomes)}
    b = {f"i{k}": rb for k, (_, rb) in enumerate(outcomes)}
    drop = paired_compare(a, b, {i: f"repo{int(i[1:]) % 4}" for i in a})
    decision = promotion_decision(drop, max_drop=0.1, alpha=0.05)
    assert decision.verdict == "reject" and drop.mcnemar_p == pytest.approx(2 * 0.5**10)
    assert "interval [-40.2, -11.1] pp" in decision.reason and "the whole interval is below -10 pp" in decision.reason
    # at a 20-point allowance the interval reaches above it, but the drop is significant beyond it
    beyond = promotion_decision(drop, max_drop=0.2, alpha=0.05)
    assert beyond.verdict == "reject" and "a drop beyond -20 pp with McNemar p=0.00195 < 0.05" in beyond.reason
    # the same drop is tolerated when the allowance covers the whole interval
    assert promotion_decision(drop, max_drop=1.0, alpha=0.05).verdict == "promote"


def test_markdown_shows_interval_costs_and_decision() -> None:
    a, b, repo_of = three_repos()
    comparison = paired_compare(a, b, repo_of=repo_of)
    report_a = JobReport.from_trials([trial(i, r) for i, r in a.items()])
    report_b = JobReport.from_trials([trial(i, r) for i, r in b.items()])
    costs = cost_ratios({"x.0": {"input_tokens": 200}}, {"x.0": {"input_tokens": 100}})
    decision = promotion_decision(comparison, max_drop=0.02, alpha=0.05, costs=costs)
    text = render_markdown(report_a, report_b, comparison, "base", "cand", costs=costs, decision=decision)
    nc = comparison.delta_interval.newcombe
    assert (f"Delta 95% interval: {100 * nc.low:+.1f} pp to +100.0 pp, the union of Newcombe's hybrid score interval "
            f"for paired proportions {100 * nc.low:+.1f} to {100 * nc.high:+.1f} pp (Newcombe 1998") in text
    assert "and a cluster bootstrap by repository +0.0 to +100.0 pp (3 clusters, 2000 resamples, seed 0" in text
    assert "| input_tokens | 200 | 100 | 0.5 |" in text and "| wall_s | n/a | n/a | n/a |" in text
    assert "**Promotion gate: hold** (not enough evidence: 9 pairs < 30; delta +33.3 pp" in text
    assert ("Cost limits (B / A): wall_s ratio unknown (not recorded in both runs); input_tokens 0.5x <= 1.25x; "
            "agent_steps ratio unknown (not recorded in both runs).") in text
