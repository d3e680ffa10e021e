"""Job reports and paired comparisons, on cases small enough to check by hand."""

from __future__ import annotations

import math

import pytest

from forgeflow.compare import JobReport, paired_compare, render_markdown, wilson_interval
from forgeflow.errors import InputError
from forgeflow.store import TrialRecord


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
