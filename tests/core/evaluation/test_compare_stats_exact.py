"""The compare path's closed-form statistics give statsmodels' values (the library the numbers were first
computed with, kept as the reference here): the exact McNemar p-value and the Wilson interval, over every
count a canary of up to 60 pairs can produce and a few large ones."""

from __future__ import annotations

import pytest
from statsmodels.stats.contingency_tables import mcnemar
from statsmodels.stats.proportion import proportion_confint

from forgeflow.common.errors import InputError
from forgeflow.evaluation.compare.stats import mcnemar_exact_p, wilson_interval


def test_mcnemar_exact_p_is_statsmodels_value() -> None:
    cases = [(w, lost) for w in range(31) for lost in range(31)] + [(1200, 1310), (3, 2997), (0, 5000)]
    for wins, losses in cases:
        expected = 1.0 if wins + losses == 0 else float(mcnemar([[7, losses], [wins, 4]], exact=True).pvalue)
        assert mcnemar_exact_p(wins, losses) == pytest.approx(min(1.0, expected), rel=1e-9, abs=1e-300), (wins, losses)
    with pytest.raises(InputError, match="counts >= 0"):
        mcnemar_exact_p(-1, 2)


def test_wilson_interval_is_statsmodels_value() -> None:
    for n in (1, 2, 5, 27, 50, 1000):
        for successes in range(0, n + 1, max(1, n // 25)):
            for confidence in (0.9, 0.95, 0.99):
                low, high = proportion_confint(successes, n, alpha=1.0 - confidence, method="wilson")
                got = wilson_interval(successes, n, confidence)
                assert (got.low, got.high) == (pytest.approx(max(0.0, low), abs=1e-12),
                                               pytest.approx(min(1.0, high), abs=1e-12)), (successes, n)
    assert (wilson_interval(0, 10).low, wilson_interval(10, 10).high) == (0.0, 1.0)
