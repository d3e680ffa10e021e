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
rates Newcombe's lower bound would need to clear a non-inferiority margin. Every interval, and the Wilson
interval of one pass rate (:func:`forgeflow.evaluation.compare.stats.wilson_interval`), is one
:class:`ConfidenceInterval`, its ``method`` saying which."""

from __future__ import annotations

import math
from collections.abc import Mapping
from statistics import NormalDist
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from forgeflow.common.errors import InputError

NEWCOMBE_SOURCE = (
    "Newcombe 1998, Improved confidence intervals for the difference between binomial proportions "
    "based on paired data, Statistics in Medicine 17:2635-2650 (method 10)"
)
BOOTSTRAP_SOURCE = "Field and Welsh 2007, Bootstrapping clustered data, JRSS B 69(3):369-390"
WILSON_METHOD = "wilson_score"
"""``ConfidenceInterval.method`` of the Wilson score interval of one proportion (both ends in [0, 1])."""
NEWCOMBE_METHOD = "newcombe_hybrid_score"
"""``ConfidenceInterval.method`` of Newcombe's interval on a paired delta (:func:`newcombe_paired_interval`)."""
BOOTSTRAP_METHOD = "cluster_bootstrap"
"""``ConfidenceInterval.method`` of the cluster bootstrap on a paired delta (:func:`cluster_bootstrap_delta`)."""
UNION_METHOD = "union(newcombe_hybrid_score, cluster_bootstrap)"
"""``ConfidenceInterval.method`` of the reported delta interval: the union of the two above (:func:`union_interval`)."""

IntervalMethod = Literal["wilson_score", "newcombe_hybrid_score", "cluster_bootstrap",
                         "union(newcombe_hybrid_score, cluster_bootstrap)"]
"""The methods a :class:`ConfidenceInterval` names."""

_FIELDS: dict[str, tuple[str, ...]] = {
    WILSON_METHOD: ("low", "high", "confidence"),
    NEWCOMBE_METHOD: ("delta", "low", "high", "confidence", "phi", "n_pairs", "source"),
    BOOTSTRAP_METHOD: ("delta", "low", "high", "confidence", "clustered_by", "n_clusters", "n_pairs", "n_resamples",
                       "seed"),
    UNION_METHOD: ("delta", "low", "high", "confidence", "method", "source", "low_from", "high_from", "clustered_by",
                   "n_clusters", "n_pairs", "n_resamples", "seed", "newcombe", "bootstrap"),
}
"""Method -> the fields it sets, in the order it is written (the JSON of each method is unchanged since they were
four models: only the union's names its method)."""


class ConfidenceInterval(BaseModel):
    """A confidence interval: the Wilson interval of a pass rate (ends in [0, 1]), or an interval on the paired delta
    ``pass_rate_b - pass_rate_a`` (ends in [-1, 1]): Newcombe's, the cluster bootstrap's, or the reported union of
    both, which repeats the bootstrap's bookkeeping (``clustered_by``, ``n_clusters``, ``n_resamples``, ``seed``) at
    the top level and holds each alone in ``newcombe`` / ``bootstrap``.

    ``method`` says which; the fields it sets are set (the others None) and written, in :data:`_FIELDS`' order. Read
    without ``method`` (written by a Newcombe, bootstrap or Wilson interval), it is told by the fields: ``phi``:
    Newcombe, ``n_resamples``: bootstrap, else Wilson.

    Raises:
        ValueError (pydantic's ValidationError): a field of its method missing, or a Wilson end outside [0, 1].
    """

    model_config = ConfigDict(frozen=True)

    delta: float | None = Field(None, ge=-1.0, le=1.0,
                                description="The observed delta (wins - losses) / n_pairs (None: Wilson).")
    low: float = Field(ge=-1.0, le=1.0, description="Lower bound (the union: min of both; Wilson: in [0, 1]).")
    high: float = Field(ge=-1.0, le=1.0, description="Upper bound (the union: max of both).")
    confidence: float = Field(0.95, gt=0.0, lt=1.0, description="Level of the interval (the union: of both).")
    method: IntervalMethod = Field(description="How it was made: WILSON_METHOD, NEWCOMBE_METHOD, BOOTSTRAP_METHOD "
                                               "or UNION_METHOD.")
    source: str | None = Field(None, description="The paper(s) (Newcombe's and the union's).")
    low_from: Literal["newcombe", "bootstrap"] | None = Field(
        None, description="The union's: which interval gave low (newcombe on a tie).")
    high_from: Literal["newcombe", "bootstrap"] | None = Field(
        None, description="The union's: which interval gave high.")
    phi: float | None = Field(None, ge=-1.0, le=1.0,
                              description="Newcombe's: the corrected correlation of the two marginal proportions used "
                                          "(0 when a marginal total is 0).")
    clustered_by: Literal["repository", "instance"] | None = Field(
        None, description="The bootstrap's: repository (whole repositories resampled) or instance (no repository "
                          "map given: every instance is its own cluster, the plain paired bootstrap).")
    n_clusters: int | None = Field(None, ge=1, description="The bootstrap's clusters resampled.")
    n_pairs: int | float | None = Field(
        None, gt=0, description="Pairs (Newcombe's may be fractional when computed at expected counts, see "
                                "pairs_needed).")
    n_resamples: int | None = Field(None, ge=1, description="The bootstrap's resamples drawn.")
    seed: int | None = Field(None, description="The bootstrap's seed of numpy.random.default_rng.")
    newcombe: ConfidenceInterval | None = Field(None, description="The union's: Newcombe's interval alone.")
    bootstrap: ConfidenceInterval | None = Field(None, description="The union's: the cluster bootstrap alone.")

    @model_validator(mode="before")
    @classmethod
    def _told_by_fields(cls, data: object) -> object:
        if isinstance(data, dict) and "method" not in data:
            method = NEWCOMBE_METHOD if "phi" in data else BOOTSTRAP_METHOD if "n_resamples" in data else WILSON_METHOD
            return {**data, "method": method}
        return data

    @model_validator(mode="after")
    def _fields_of_method(self) -> ConfidenceInterval:
        missing = [name for name in _FIELDS[self.method] if getattr(self, name) is None]
        if missing:
            raise ValueError(f"a {self.method} interval needs {', '.join(missing)}")
        if self.method == WILSON_METHOD and not 0.0 <= self.low <= self.high <= 1.0:
            raise ValueError(f"a Wilson interval has 0 <= low <= high <= 1, got [{self.low}, {self.high}]")
        return self

    @model_serializer(mode="wrap")
    def _written(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        data = handler(self)
        return {name: data[name] for name in _FIELDS[self.method]}


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise InputError(f"confidence must be in (0, 1), got {confidence}")


def normal_quantile(confidence: float) -> float:
    """The two-sided standard normal quantile of ``confidence`` (1.96 at 0.95)."""
    return NormalDist().inv_cdf(0.5 + confidence / 2.0)


# --- cluster bootstrap ---------------------------------------------------------------------------
def cluster_bootstrap_delta(
    pairs: Mapping[str, tuple[bool, bool]],
    cluster_of: Mapping[str, str] | None = None,
    *,
    n_resamples: int = 2000,
    seed: int = 0,
    confidence: float = 0.95,
) -> ConfidenceInterval:
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
    return ConfidenceInterval(
        method=BOOTSTRAP_METHOD,
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
) -> ConfidenceInterval:
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
    return ConfidenceInterval(
        method=NEWCOMBE_METHOD,
        source=NEWCOMBE_SOURCE,
        delta=min(1.0, max(-1.0, delta)),
        low=max(-1.0, delta - down),
        high=min(1.0, delta + up),
        confidence=confidence,
        phi=phi,
        n_pairs=n,
    )


# --- the reported interval: the union -------------------------------------------------------------
def union_interval(newcombe: ConfidenceInterval, bootstrap: ConfidenceInterval) -> ConfidenceInterval:
    """The union of Newcombe's interval and the cluster bootstrap's on the same pairs: ``low = min(newcombe.low,
    bootstrap.low)``, ``high = max(newcombe.high, bootstrap.high)``, never narrower than either, and never of zero
    width (Newcombe's interval has positive width for any n >= 1); the method :data:`UNION_METHOD`.

    Raises:
        InputError: the two were computed on different pairs or at different levels, or are not a Newcombe and a
            bootstrap interval.
    """
    if (newcombe.method, bootstrap.method) != (NEWCOMBE_METHOD, BOOTSTRAP_METHOD):
        raise InputError(f"union_interval takes a {NEWCOMBE_METHOD} and a {BOOTSTRAP_METHOD} interval, got "
                         f"{newcombe.method} and {bootstrap.method}")
    if abs(newcombe.confidence - bootstrap.confidence) > 1e-12 or abs(newcombe.n_pairs - bootstrap.n_pairs) > 1e-9:
        raise InputError(
            f"union_interval needs both intervals on the same pairs and level: Newcombe n={newcombe.n_pairs:g} at "
            f"{newcombe.confidence:g}, bootstrap n={bootstrap.n_pairs} at {bootstrap.confidence:g}"
        )
    return ConfidenceInterval(
        method=UNION_METHOD,
        source=f"{NEWCOMBE_SOURCE}; {BOOTSTRAP_SOURCE}",
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
