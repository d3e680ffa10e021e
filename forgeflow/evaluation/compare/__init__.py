"""Job reports and paired comparisons of two evaluation runs (canary A vs B).

* Wilson score interval for a pass rate (:func:`forgeflow.evaluation.paired_stats.wilson_limits`; Wilson 1927;
  recommended over the normal interval by Brown, Cai and DasGupta 2001, "Interval Estimation for a Binomial
  Proportion"); statsmodels' ``proportion_confint(..., method="wilson")``.
* McNemar's exact test on the discordant pairs (:func:`.stats.mcnemar_exact_p`; McNemar 1947);
  statsmodels' ``mcnemar(table, exact=True)``.
* Paired interval on the delta (:mod:`forgeflow.evaluation.paired_stats`): the union of Newcombe's hybrid
  score interval (Newcombe 1998, Statistics in Medicine 17:2635-2650, method 10) and a repository cluster
  bootstrap (Field and Welsh 2007, "Bootstrapping clustered data", JRSS B 69(3); Miller 2024, "Adding Error
  Bars to Evals", arXiv:2411.00640)."""

from __future__ import annotations

from forgeflow.evaluation.compare.exclusions import (
    DEFAULT_MAX_EXCEPTION_RATE,
    ExclusionCount,
    JobExclusions,
    exclusion_lines,
    job_exclusions,
)
from forgeflow.evaluation.compare.jobs import (
    ComparisonFiles,
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
    JobReport,
    PairCounts,
    PairedComparison,
    TrialOutcome,
    cost_ratios,
    paired_compare,
    rewards_by_instance,
    wilson_interval,
)
from forgeflow.evaluation.paired_stats import ConfidenceInterval

__all__ = [
    "COST_METRICS",
    "DEFAULT_MAX_EXCEPTION_RATE",
    "ComparisonFiles",
    "ConfidenceInterval",
    "ComparisonSettings",
    "CostComparison",
    "CostMetric",
    "ExcludedTask",
    "ExclusionCount",
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
