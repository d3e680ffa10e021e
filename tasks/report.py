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
    (with the cost ratios over the paired instances: mean input tokens, agent steps, wall seconds).

    An exception trial enters the pairs as None (excluded, and listed with its reason), never as
    reward 0.
    """
    report_a = compare.JobReport.from_trials(baseline)
    report_b = compare.JobReport.from_trials(candidate)
    rewards_a, rewards_b = compare.rewards_by_instance(baseline), compare.rewards_by_instance(candidate)
    paired = compare.paired_compare(rewards_a, rewards_b, repo_of, seed=seed, confidence=1.0 - alpha)
    decision = compare.promotion_decision(paired, max_drop=max_drop, alpha=alpha)
    paired_ids = [i for i in rewards_a if rewards_a[i] is not None and rewards_b.get(i) is not None]
    costs = compare.cost_ratios({t.instance_id: t.costs() for t in baseline},
                                {t.instance_id: t.costs() for t in candidate}, paired_ids)
    excluded = compare.excluded_tasks(baseline, candidate)
    notes = (["excluded from the pairs: " + "; ".join(f"{e.instance_id} ({e.reason})" for e in excluded)]
             if excluded else [])
    markdown = compare.render_markdown(report_a, report_b, paired, label_a, label_b, costs=costs,
                                       decision=decision, notes=notes)
    return compare.CanaryComparison(report_a=report_a, report_b=report_b, paired=paired, decision=decision,
                                    costs=costs, markdown=markdown, excluded=excluded)
