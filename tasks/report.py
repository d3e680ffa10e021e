"""Prefect task of the compare stage: paired statistics and the markdown report."""

from __future__ import annotations

from prefect import task

from forgeflow import compare
from forgeflow.trial import TrialRecord
from tasks.common import RESUMABLE


@task(cache_policy=RESUMABLE)
def compare_jobs(baseline: list[TrialRecord], candidate: list[TrialRecord], label_a: str, label_b: str,
                 repo_of: dict[str, str], max_drop: float, alpha: float, seed: int) -> compare.CanaryComparison:
    """Job reports of both canaries, their paired comparison (exact McNemar, repository-clustered
    bootstrap interval at confidence ``1 - alpha``), the promotion gate's decision and the markdown
    (with the cost ratios: mean input tokens, agent steps, wall seconds).

    An exception trial enters the pairs as None (excluded and counted), never as reward 0.
    """
    report_a = compare.JobReport.from_trials(baseline)
    report_b = compare.JobReport.from_trials(candidate)
    paired = compare.paired_compare(compare.rewards_by_instance(baseline), compare.rewards_by_instance(candidate),
                                    repo_of, seed=seed, confidence=1.0 - alpha)
    decision = compare.promotion_decision(paired, max_drop=max_drop, alpha=alpha)
    costs = compare.cost_ratios({t.instance_id: t.costs() for t in baseline},
                                {t.instance_id: t.costs() for t in candidate})
    markdown = compare.render_markdown(report_a, report_b, paired, label_a, label_b, costs=costs,
                                       decision=decision)
    return compare.CanaryComparison(report_a=report_a, report_b=report_b, paired=paired, decision=decision,
                                    costs=costs, markdown=markdown)
