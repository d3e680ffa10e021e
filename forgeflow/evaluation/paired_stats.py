"""Intervals on the paired delta of two evaluation runs (candidate B minus baseline A).

* **Newcombe's hybrid score interval for the difference of paired proportions** — Newcombe 1998,
  "Improved confidence intervals for the difference between binomial proportions based on paired
  data", Statistics in Medicine 17:2635-2650, method 10: the Wilson score limits of both marginal
  proportions, combined ("square and add") with a correction for their correlation ``phi``. Valid at
  small n (Newcombe's coverage study; Fagerland, Lydersen and Laake 2014, "Recommended tests and
  confidence intervals for paired binomial proportions", Statistics in Medicine 33:2850-2875,
  recommend it), never of zero width, but blind to clustering.
* **A percentile cluster bootstrap** that resamples whole repositories (Field and Welsh 2007,
  "Bootstrapping clustered data", JRSS B 69(3):369-390; Miller 2024, "Adding Error Bars to Evals",
  arXiv:2411.00640): honest about tasks sharing a repository, but degenerate with few clusters or
  no discordant pair (two repositories with only ties resample to ``[0, 0]``).

The union ``[min(lows), max(highs)]`` is never narrower than either, so a zero-width interval from
resampling is never what is reported. :func:`pairs_needed` says how many pairs at the observed
rates Newcombe's lower bound would need to clear a non-inferiority margin."""

from __future__ import annotations

import math
from collections.abc import Mapping
from statistics import NormalDist
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common.errors import InputError

NEWCOMBE_SOURCE = (
    "Newcombe 1998, Improved confidence intervals for the difference between binomial proportions "
    "based on paired data, Statistics in Medicine 17:2635-2650 (method 10)"
)
BOOTSTRAP_SOURCE = "Field and Welsh 2007, Bootstrapping clustered data, JRSS B 69(3):369-390"
UNION_METHOD = "union(newcombe_hybrid_score, cluster_bootstrap)"
"""``DeltaInterval.method``: the reported interval is the union of the two below."""


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise InputError(f"confidence must be in (0, 1), got {confidence}")


def normal_quantile(confidence: float) -> float:
    """The two-sided standard normal quantile of ``confidence`` (1.96 at 0.95)."""
    return NormalDist().inv_cdf(0.5 + confidence / 2.0)


# --- cluster bootstrap ---------------------------------------------------------------------------
class ClusteredInterval(BaseModel):
    """A bootstrap interval on the paired delta ``pass_rate_b - pass_rate_a``."""

    model_config = ConfigDict(frozen=True)

    delta: float = Field(ge=-1.0, le=1.0, description="The observed delta over all pairs.")
    low: float = Field(ge=-1.0, le=1.0, description="Lower percentile bound (in [-1, 1]).")
    high: float = Field(ge=-1.0, le=1.0, description="Upper percentile bound.")
    confidence: float = Field(gt=0.0, lt=1.0, description="Level of the interval.")
    clustered_by: Literal["repository", "instance"] = Field(
        description="repository (whole repositories resampled) or instance (no repository map given: every instance "
                    "is its own cluster, the plain paired bootstrap).")
    n_clusters: int = Field(ge=1, description="Clusters resampled.")
    n_pairs: int = Field(ge=1, description="Pairs in the clusters.")
    n_resamples: int = Field(ge=1, description="Bootstrap resamples drawn.")
    seed: int = Field(description="Seed of numpy.random.default_rng.")


def cluster_bootstrap_delta(
    pairs: Mapping[str, tuple[bool, bool]],
    cluster_of: Mapping[str, str] | None = None,
    *,
    n_resamples: int = 2000,
    seed: int = 0,
    confidence: float = 0.95,
) -> ClusteredInterval:
    """Percentile cluster-bootstrap interval on the paired delta (Field and Welsh 2007).

    Args:
        cluster_of: Instance id -> cluster (repository); None: every instance is its own cluster.
        n_resamples: Bootstrap resamples (>= 100).

    Raises:
        InputError: no pairs, a paired instance without a cluster, ``n_resamples < 100`` or ``confidence``
            outside (0, 1).
    """
    if not pairs:
        raise InputError("cluster_bootstrap_delta needs at least one pair")
    if n_resamples < 100:
        raise InputError(f"n_resamples must be >= 100, got {n_resamples}")
    _check_confidence(confidence)
    if cluster_of is not None:
        unknown = sorted(i for i in pairs if i not in cluster_of)
        if unknown:
            raise InputError(f"cluster_of has no repository for paired instances {unknown[:5]}")
    diff: dict[str, int] = {}
    size: dict[str, int] = {}
    for instance_id in sorted(pairs):
        passed_a, passed_b = pairs[instance_id]
        cluster = cluster_of[instance_id] if cluster_of is not None else instance_id
        diff[cluster] = diff.get(cluster, 0) + int(passed_b) - int(passed_a)
        size[cluster] = size.get(cluster, 0) + 1
    names = sorted(diff)
    d = np.array([diff[c] for c in names], dtype=float)
    n = np.array([size[c] for c in names], dtype=float)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(names), size=(n_resamples, len(names)))
    deltas = d[draws].sum(axis=1) / n[draws].sum(axis=1)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(deltas, [tail, 1.0 - tail])
    return ClusteredInterval(
        delta=float(d.sum() / n.sum()),
        low=float(np.clip(low, -1.0, 1.0)),
        high=float(np.clip(high, -1.0, 1.0)),
        confidence=confidence,
        clustered_by="repository" if cluster_of is not None else "instance",
        n_clusters=len(names),
        n_pairs=int(n.sum()),
        n_resamples=n_resamples,
        seed=seed,
    )


# --- Newcombe's hybrid score interval for paired proportions ----------------------------------------
class NewcombeInterval(BaseModel):
    """Newcombe's (1998, method 10) interval on ``pass_rate_b - pass_rate_a`` of paired outcomes."""

    model_config = ConfigDict(frozen=True)

    delta: float = Field(ge=-1.0, le=1.0, description="(wins - losses) / n_pairs.")
    low: float = Field(ge=-1.0, le=1.0, description="Lower limit, in [-1, 1].")
    high: float = Field(ge=-1.0, le=1.0, description="Upper limit, in [-1, 1].")
    confidence: float = Field(gt=0.0, lt=1.0, description="Level of the interval.")
    phi: float = Field(ge=-1.0, le=1.0,
                       description="The corrected correlation of the two marginal proportions used (0 when a "
                                   "marginal total is 0).")
    n_pairs: float = Field(gt=0.0,
                           description="Pairs (may be fractional when computed at expected counts, see "
                                       "pairs_needed).")
    source: str = Field(NEWCOMBE_SOURCE, description="The paper.")


def wilson_limits(successes: float, n: float, z: float) -> tuple[float, float]:
    """Wilson (1927) score limits of ``successes / n`` (``n`` > 0; real-valued counts allowed) at normal
    quantile ``z``; 0 and 1 exactly at 0 and ``n`` successes. The same limits as statsmodels'
    ``proportion_confint(..., method="wilson")`` (tests/core/evaluation/test_compare_stats_exact.py)."""
    centre = (successes + z * z / 2.0) / (n + z * z)
    half = z * math.sqrt(max(0.0, successes * (n - successes) / n) + z * z / 4.0) / (n + z * z)
    low = 0.0 if successes <= 0 else max(0.0, centre - half)
    high = 1.0 if successes >= n else min(1.0, centre + half)
    return low, high


def newcombe_paired_interval(
    both_pass: float, wins: float, losses: float, both_fail: float, confidence: float = 0.95
) -> NewcombeInterval:
    """Newcombe's hybrid score interval for the difference of paired proportions (method 10).

    In Newcombe's notation the 2x2 table has rows = run B (pass, fail) and columns = run A, with
    cells ``a = both_pass``, ``b = wins`` (B only), ``c = losses`` (A only), ``d = both_fail``,
    ``n = a + b + c + d``; ``p1 = (a + b) / n`` (B's pass rate), ``p2 = (a + c) / n`` (A's) and
    ``delta = p1 - p2``. With ``[l1, u1]`` and ``[l2, u2]`` the Wilson score limits of ``p1`` and
    ``p2``::

        L = delta - sqrt((p1 - l1)**2 - 2 phi (p1 - l1)(u2 - p2) + (u2 - p2)**2)
        U = delta + sqrt((u1 - p1)**2 - 2 phi (u1 - p1)(p2 - l2) + (p2 - l2)**2)

    where ``phi`` estimates the correlation of the two marginal proportions, with Newcombe's
    adjustment of the numerator ``A = ad - bc``: ``(A - n/2) / sqrt(D)`` when ``A > n/2``, 0 when
    ``0 <= A <= n/2``, ``A / sqrt(D)`` when ``A < 0``, where ``D = (a+b)(c+d)(a+c)(b+d)`` is the
    product of the marginal totals; ``phi = 0`` when any marginal total is 0. The limits are
    truncated to [-1, 1]. Checked against Fagerland, Lydersen and Laake's worked example (Cavo et
    al. 2012, table [[59, 6], [16, 80]]: -0.0621, 95% CI -0.1186 to -0.0046).

    Args:
        confidence: Interval level in (0, 1).

    Raises:
        InputError: a count is negative or not finite, there are no pairs, or ``confidence`` is
            outside (0, 1).
    """
    _check_confidence(confidence)
    cells = {"both_pass": both_pass, "wins": wins, "losses": losses, "both_fail": both_fail}
    for name, value in cells.items():
        if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
            raise InputError(f"newcombe_paired_interval: {name} must be a finite count >= 0, got {value!r}")
    a, b, c, d = (float(v) for v in cells.values())
    n = a + b + c + d
    if n <= 0:
        raise InputError("newcombe_paired_interval needs at least one pair")
    z = normal_quantile(confidence)
    p1, p2 = (a + b) / n, (a + c) / n
    delta = (b - c) / n
    l1, u1 = wilson_limits(a + b, n, z)
    l2, u2 = wilson_limits(a + c, n, z)
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    numerator = a * d - b * c
    if margins <= 0:
        phi = 0.0
    elif numerator > n / 2.0:
        phi = (numerator - n / 2.0) / math.sqrt(margins)
    elif numerator >= 0:
        phi = 0.0
    else:
        phi = numerator / math.sqrt(margins)
    phi = min(1.0, max(-1.0, phi))
    down = math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    up = math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    return NewcombeInterval(
        delta=min(1.0, max(-1.0, delta)),
        low=max(-1.0, delta - down),
        high=min(1.0, delta + up),
        confidence=confidence,
        phi=phi,
        n_pairs=n,
    )


# --- the reported interval: the union -------------------------------------------------------------
class DeltaInterval(BaseModel):
    """The reported interval on the paired delta: the union of Newcombe's and the cluster bootstrap's.

    ``low = min(newcombe.low, bootstrap.low)``, ``high = max(newcombe.high, bootstrap.high)``: never
    narrower than either, and never of zero width (Newcombe's interval has positive width for any
    n >= 1). The bootstrap's bookkeeping (``clustered_by``, ``n_clusters``, ``n_resamples``,
    ``seed``) is repeated at the top level."""

    model_config = ConfigDict(frozen=True)

    delta: float = Field(ge=-1.0, le=1.0, description="The observed delta (wins - losses) / n_pairs.")
    low: float = Field(ge=-1.0, le=1.0, description="Lower bound of the union, in [-1, 1].")
    high: float = Field(ge=-1.0, le=1.0, description="Upper bound of the union.")
    confidence: float = Field(gt=0.0, lt=1.0, description="Level of both intervals.")
    method: str = Field(UNION_METHOD, description="UNION_METHOD.")
    source: str = Field(f"{NEWCOMBE_SOURCE}; {BOOTSTRAP_SOURCE}", description="The papers of both intervals.")
    low_from: Literal["newcombe", "bootstrap"] = Field(description="Which interval gave low (newcombe on a tie).")
    high_from: Literal["newcombe", "bootstrap"] = Field(description="Which interval gave high.")
    clustered_by: Literal["repository", "instance"] = Field(
        description="repository or instance (the bootstrap's clusters).")
    n_clusters: int = Field(ge=1,
                            description="Clusters the bootstrap resampled (repositories when clustered_by says so).")
    n_pairs: int = Field(ge=1, description="Pairs.")
    n_resamples: int = Field(ge=1, description="Bootstrap resamples.")
    seed: int = Field(description="Bootstrap seed.")
    newcombe: NewcombeInterval = Field(description="Newcombe's interval alone.")
    bootstrap: ClusteredInterval = Field(description="The cluster bootstrap alone.")


def union_interval(newcombe: NewcombeInterval, bootstrap: ClusteredInterval) -> DeltaInterval:
    """The union of the two intervals on the same pairs (see :class:`DeltaInterval`).

    Raises:
        InputError: the two were computed on different pairs or at different levels.
    """
    if abs(newcombe.confidence - bootstrap.confidence) > 1e-12 or abs(newcombe.n_pairs - bootstrap.n_pairs) > 1e-9:
        raise InputError(
            f"union_interval needs both intervals on the same pairs and level: Newcombe n={newcombe.n_pairs:g} at "
            f"{newcombe.confidence:g}, bootstrap n={bootstrap.n_pairs} at {bootstrap.confidence:g}"
        )
    return DeltaInterval(
        delta=bootstrap.delta,
        low=min(newcombe.low, bootstrap.low),
        high=max(newcombe.high, bootstrap.high),
        confidence=bootstrap.confidence,
        low_from="newcombe" if newcombe.low <= bootstrap.low else "bootstrap",
        high_from="newcombe" if newcombe.high >= bootstrap.high else "bootstrap",
        clustered_by=bootstrap.clustered_by,
        n_clusters=bootstrap.n_clusters,
        n_pairs=bootstrap.n_pairs,
        n_resamples=bootstrap.n_resamples,
        seed=bootstrap.seed,
        newcombe=newcombe,
        bootstrap=bootstrap,
    )


def pairs_needed(
    both_pass: int, wins: int, losses: int, both_fail: int, max_drop: float, confidence: float = 0.95,
    *, n_max: int = 1_000_000,
) -> int | None:
    """The smallest number of pairs, at the observed cell proportions, for which Newcombe's lower bound would
    reach ``-max_drop``: a doubling search then bisection over real-valued expected counts. A planning
    figure, not a promise.

    Returns:
        The number of pairs, or None when no n up to ``n_max`` would (the observed delta is at or below
        ``-max_drop``).

    Raises:
        InputError: a count is negative, there are no pairs, or ``max_drop`` is outside [0, 1].
    """
    if not 0.0 <= max_drop <= 1.0:
        raise InputError(f"max_drop must be in [0, 1], got {max_drop}")
    counts = (both_pass, wins, losses, both_fail)
    if any(c < 0 for c in counts) or sum(counts) <= 0:
        raise InputError(f"pairs_needed needs counts >= 0 and at least one pair, got {counts}")
    observed = float(sum(counts))

    def clears(n: int) -> bool:
        scaled = [c * n / observed for c in counts]
        return newcombe_paired_interval(*scaled, confidence=confidence).low >= -max_drop

    if (wins - losses) / observed <= -max_drop or not clears(n_max):
        return None
    high = 1
    while not clears(high):
        high *= 2
    low = high // 2  # clears(low) is False (or low == 0)
    while high - low > 1:
        mid = (low + high) // 2
        if clears(mid):
            high = mid
        else:
            low = mid
    return high
