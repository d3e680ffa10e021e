"""Job reports and paired comparisons of two evaluation runs (canary A vs B).

Outcomes are binary: a scored trial *passes* when its reward is >= 1.0 (all FAIL_TO_PASS and
PASS_TO_PASS tests pass, SWE-bench's "resolved"). A trial that ended in an infrastructure
exception has no reward: it is counted by exception type, never as a failure of the model, and
it is left out of the paired comparison (as SWE-bench keeps infra failures out of the score).

Statistics (closed forms in the standard library, each checked against statsmodels' value in
tests/core/evaluation/test_compare_stats_exact.py; statsmodels itself is not imported on this path: its import
alone took 1-3.6 s of a ``forgeflow compare`` that must answer within 2 s at a million trials):

* Wilson score interval for a pass rate (:func:`forgeflow.evaluation.paired_stats.wilson_limits`; Wilson 1927;
  recommended over the normal interval by Brown, Cai and DasGupta 2001, "Interval Estimation for a Binomial
  Proportion"); statsmodels' ``proportion_confint(..., method="wilson")``.
* McNemar's exact test on the discordant pairs of a paired comparison (:func:`.stats.mcnemar_exact_p`: a
  two-sided binomial test with p = 0.5 on the pairs where exactly one run passed; McNemar 1947);
  statsmodels' ``mcnemar(table, exact=True)``.
* Paired interval on the delta (:mod:`forgeflow.evaluation.paired_stats`): the union of Newcombe's hybrid
  score interval for paired proportions (Newcombe 1998, Statistics in Medicine 17:2635-2650,
  method 10; valid at small n) and a cluster bootstrap that resamples whole repositories (Field
  and Welsh 2007, "Bootstrapping clustered data", JRSS B 69(3); Miller 2024, "Adding Error Bars to
  Evals", arXiv:2411.00640), so it is never narrower than either and never of zero width. numpy
  ``default_rng(seed)``: the same seed gives the same interval.

Before comparing, :func:`refuse_unless_same_split` checks that both runs ran the same frozen split,
and :func:`promotion_decision` (:mod:`forgeflow.evaluation.compare.gate`) turns a comparison and its cost ratios into
promote / hold / reject: it needs enough pairs, repositories and an interval that excludes the
allowed drop, and it holds when a cost ratio is over its limit.

Modules: :mod:`.stats` (pass rates, paired comparison, cost ratios), :mod:`.exclusions` (the trials
a job's numbers leave out, per exception type with the rate, and the limit above which a job is unusable
for a comparison), :mod:`.jobs` (stored jobs, merged with their recovery jobs), :mod:`.report`
(markdown), :mod:`.plot` (the figure); their public
names are re-exported here.

Jobs recorded in the store are compared by :func:`compare_stored_jobs`: each job is read as a
:class:`MergedJob` (the original plus its recovery jobs, labelled "original job X + N recovery
jobs"), :func:`refuse_unless_same_frozen_split` reads the jobs table's freeze and split, the delta
interval is clustered by ``task_instances.repo``, excluded tasks carry their reasons, and the cost
ratios come from the stored trial columns. :func:`render_plot` draws the pass rates with their
Wilson intervals and the wins/losses per repository (matplotlib, Agg canvas).
"""

from __future__ import annotations

from forgeflow.evaluation.compare.exclusions import (
    DEFAULT_MAX_EXCEPTION_RATE,
    ExclusionCount,
    JobExclusions,
    exclusion_lines,
    job_exclusions,
)
from forgeflow.evaluation.compare.jobs import (
    CanaryComparison,
    ComparisonSettings,
    ExcludedTask,
    MergedJob,
    StoredJobsComparison,
    compare_stored_jobs,
    excluded_tasks,
    merged_job,
    refuse_unless_same_frozen_split,
    refuse_unless_same_split,
    stored_costs,
)
from forgeflow.evaluation.compare.plot import (
    render_plot,
)
from forgeflow.evaluation.compare.report import (
    render_markdown,
)
from forgeflow.evaluation.compare.stats import (
    COST_METRICS,
    PASS_REWARD,
    CostComparison,
    CostMetric,
    Interval,
    JobReport,
    PairCounts,
    PairedComparison,
    TrialOutcome,
    cost_ratios,
    paired_compare,
    rewards_by_instance,
    wilson_interval,
)

__all__ = [
    "COST_METRICS",
    "DEFAULT_MAX_EXCEPTION_RATE",
    "CanaryComparison",
    "ComparisonSettings",
    "CostComparison",
    "CostMetric",
    "ExcludedTask",
    "ExclusionCount",
    "Interval",
    "JobExclusions",
    "JobReport",
    "MergedJob",
    "PASS_REWARD",
    "PairCounts",
    "PairedComparison",
    "StoredJobsComparison",
    "TrialOutcome",
    "compare_stored_jobs",
    "cost_ratios",
    "excluded_tasks",
    "exclusion_lines",
    "job_exclusions",
    "merged_job",
    "paired_compare",
    "refuse_unless_same_frozen_split",
    "refuse_unless_same_split",
    "render_markdown",
    "render_plot",
    "rewards_by_instance",
    "stored_costs",
    "wilson_interval",
]
