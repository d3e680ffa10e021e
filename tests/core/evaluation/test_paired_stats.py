"""Newcombe's paired interval against a published worked example and its boundary properties; the
union with the cluster bootstrap; the pairs a margin would need."""

from __future__ import annotations

import math

import pytest

from forgeflow.common.errors import InputError
from forgeflow.evaluation.compare import wilson_interval
from forgeflow.evaluation.paired_stats import (
    NEWCOMBE_SOURCE,
    UNION_METHOD,
    cluster_bootstrap_delta,
    newcombe_paired_interval,
    pairs_needed,
    union_interval,
)

Z95 = 1.959963984540054


def test_newcombe_matches_the_published_worked_example() -> None:
    """Cavo et al. 2012 (complete response before / after consolidation therapy), the paired table
    [[59, 6], [16, 80]] worked in Fagerland, Lydersen and Laake 2014 (Stat Med 33:2850) and in their
    R package contingencytables: Newcombe square-and-add, -0.0621 (95% CI -0.1186 to -0.0046)."""
    ci = newcombe_paired_interval(both_pass=59, wins=6, losses=16, both_fail=80)
    assert round(ci.delta, 4) == -0.0621
    assert (round(ci.low, 4), round(ci.high, 4)) == (-0.1186, -0.0046)
    # A = 59 * 80 - 6 * 16 = 4624 > n/2: phi = (A - n/2) / sqrt(65 * 96 * 75 * 86), Newcombe's adjustment
    assert ci.phi == pytest.approx((4624 - 161 / 2) / math.sqrt(65 * 96 * 75 * 86))
    assert ci.source == NEWCOMBE_SOURCE and "2635-2650" in ci.source


def test_newcombe_by_hand_on_a_small_table() -> None:
    """a=3, b=3, c=0, d=3 (n=9): A = 9 - 0 = 9 > n/2 = 4.5, so phi = 4.5 / sqrt(6 * 3 * 3 * 6)."""
    ci = newcombe_paired_interval(3, 3, 0, 3)
    l1, u1 = (wilson_interval(6, 9).low, wilson_interval(6, 9).high)
    l2, u2 = (wilson_interval(3, 9).low, wilson_interval(3, 9).high)
    p1, p2, phi = 6 / 9, 3 / 9, 4.5 / 18
    low = (p1 - p2) - math.sqrt((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2)
    high = (p1 - p2) + math.sqrt((u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2)
    assert ci.phi == pytest.approx(phi)
    assert (ci.low, ci.high) == (pytest.approx(low, abs=1e-12), pytest.approx(high, abs=1e-12))


def test_phi_is_zero_when_a_marginal_total_is_zero_or_the_association_is_within_n_over_2() -> None:
    # all both-fail (the demo): B's and A's pass totals are 0 -> phi 0, interval = -+ Wilson's upper limit
    demo = newcombe_paired_interval(0, 0, 0, 6)
    assert demo.phi == 0.0 and demo.delta == 0.0
    assert demo.high == pytest.approx(Z95**2 / (6 + Z95**2)) == pytest.approx(-demo.low)
    assert (round(100 * demo.low, 1), round(100 * demo.high, 1)) == (-39.0, 39.0)
    # 0 <= ad - bc <= n/2: phi is set to 0 (Newcombe's correction), not (ad - bc) / sqrt(D)
    assert newcombe_paired_interval(1, 1, 1, 2).phi == 0.0  # A = 2 - 1 = 1 <= 2.5
    # ad - bc < 0: phi keeps its sign, uncorrected
    assert newcombe_paired_interval(0, 3, 3, 32).phi == pytest.approx(-9 / math.sqrt(3 * 35 * 3 * 35))


def test_newcombe_boundaries_and_symmetry() -> None:
    for cells in [(0, 0, 0, 1), (0, 5, 0, 0), (0, 0, 5, 0), (7, 0, 0, 0), (2, 9, 1, 0), (4, 4, 4, 4)]:
        ci = newcombe_paired_interval(*cells)
        assert -1.0 <= ci.low <= ci.delta <= ci.high <= 1.0, cells
        assert ci.high - ci.low > 0.0, cells  # never of zero width
    # swapping B and A mirrors the interval
    ab, ba = newcombe_paired_interval(5, 7, 2, 11), newcombe_paired_interval(5, 2, 7, 11)
    assert (ab.low, ab.high) == (pytest.approx(-ba.high), pytest.approx(-ba.low))
    # all wins: delta 1, the upper limit is exactly 1
    assert newcombe_paired_interval(0, 5, 0, 0).high == 1.0
    # a higher level is wider
    assert newcombe_paired_interval(5, 7, 2, 11, 0.99).low < ab.low
    with pytest.raises(InputError, match="wins must be a finite count"):
        newcombe_paired_interval(1, -1, 0, 0)
    with pytest.raises(InputError, match="at least one pair"):
        newcombe_paired_interval(0, 0, 0, 0)
    with pytest.raises(InputError, match="confidence"):
        newcombe_paired_interval(1, 0, 0, 0, confidence=1.0)


def test_union_is_never_narrower_than_either_and_never_zero_width() -> None:
    """Six both-fail pairs from 2 repositories (the demo): the bootstrap resamples to [0, 0]."""
    pairs = {f"i{k}": (False, False) for k in range(6)}
    boot = cluster_bootstrap_delta(pairs, {i: f"repo{int(i[1:]) % 2}" for i in pairs})
    assert (boot.low, boot.high, boot.n_clusters) == (0.0, 0.0, 2)
    union = union_interval(newcombe_paired_interval(0, 0, 0, 6), boot)
    assert (round(100 * union.low, 1), round(100 * union.high, 1)) == (-39.0, 39.0)
    assert union.method == UNION_METHOD and "Newcombe 1998" in union.source and "Field and Welsh 2007" in union.source
    assert (union.n_clusters, union.clustered_by, union.n_pairs) == (2, "repository", 6)
    # when the bootstrap is wider on one side, that side is the bootstrap's
    wide = cluster_bootstrap_delta({"x.1": (False, True), "x.2": (False, True), "y.1": (False, False),
                                    "z.1": (False, False)}, {"x.1": "x", "x.2": "x", "y.1": "y", "z.1": "z"})
    both = union_interval(newcombe_paired_interval(0, 2, 0, 2), wide)
    assert both.low == min(both.newcombe.low, wide.low) and both.high == max(both.newcombe.high, wide.high)
    assert both.low <= both.newcombe.low and both.high >= both.newcombe.high
    assert both.low <= wide.low and both.high >= wide.high
    with pytest.raises(InputError, match="same pairs"):
        union_interval(newcombe_paired_interval(0, 0, 0, 5), boot)


def test_pairs_needed_at_the_observed_rates() -> None:
    # all both-fail: Newcombe's low is -z^2 / (n + z^2); it reaches -5 pp at n >= 19 z^2 = 72.99
    assert pairs_needed(0, 0, 0, 6, max_drop=0.05) == 73
    assert newcombe_paired_interval(0, 0, 0, 73).low >= -0.05 > newcombe_paired_interval(0, 0, 0, 72).low
    # 3 wins / 32 ties / 3 losses (16 both pass): the smallest n whose scaled table clears -5 pp
    n = pairs_needed(16, 3, 3, 16, max_drop=0.05)
    scale = n / 38
    assert newcombe_paired_interval(16 * scale, 3 * scale, 3 * scale, 16 * scale).low >= -0.05
    smaller = (n - 1) / 38
    assert newcombe_paired_interval(16 * smaller, 3 * smaller, 3 * smaller, 16 * smaller).low < -0.05
    # a table that already clears needs no more than it has; a delta at or below -max_drop never clears
    assert pairs_needed(25, 20, 0, 15, max_drop=0.05) <= 60
    assert pairs_needed(10, 0, 5, 10, max_drop=0.05) is None
    assert pairs_needed(10, 0, 0, 10, max_drop=0.0) is None
    with pytest.raises(InputError, match="max_drop"):
        pairs_needed(1, 0, 0, 1, max_drop=-0.1)
