"""Prefect task of the compare stage: paired statistics and the markdown report."""

from __future__ import annotations

from prefect import task

from forgeflow import compare
from forgeflow.trial import TrialRecord
from tasks.common import RESUMABLE


@task(cache_policy=RESUMABLE)
def compare_jobs(baseline: list[TrialRecord], candidate: list[TrialRecord], label_a: str, label_b: str,
                 repo_of: dict[str, str], max_drop: float, alpha: float, seed: int, *, min_pairs: int = 30,
                 min_repos: int = 3, max_wall_s_ratio: float | None = 1.5, max_input_tokens_ratio: float | None = 1.25,
                 max_agent_steps_ratio: float | None = 1.25) -> compare.CanaryComparison:
    """Job reports of both canaries, their paired comparison (exact McNemar; the delta interval at
    confidence ``1 - alpha``: Newcombe's paired interval united with the repository-clustered
    bootstrap), the cost ratios over the paired instances (mean input tokens, agent steps, wall
    seconds), the promotion gate's decision on both and the markdown.

    The gate settings (``max_drop`` ... ``max_agent_steps_ratio``) are those of
    :class:`forgeflow.gate.GatePolicy` (the lifecycle passes its ``promotion_*`` fields).

    An exception trial enters the pairs as None (excluded, and listed with its reason), never as
    reward 0.

    Raises:
        InputError: a gate setting is out of range (named).
    """
    policy = compare.GatePolicy.build(max_drop=max_drop, alpha=alpha, min_pairs=min_pairs, min_repos=min_repos,
                                      max_wall_s_ratio=max_wall_s_ratio, max_input_tokens_ratio=max_input_tokens_ratio,
                                      max_agent_steps_ratio=max_agent_steps_ratio)
    report_a = compare.JobReport.from_trials(baseline)
    report_b = compare.JobReport.from_trials(candidate)
    rewards_a, rewards_b = compare.rewards_by_instance(baseline), compare.rewards_by_instance(candidate)
    paired = compare.paired_compare(rewards_a, rewards_b, repo_of, seed=seed, confidence=1.0 - alpha)
    paired_ids = [i for i in rewards_a if rewards_a[i] is not None and rewards_b.get(i) is not None]
    costs = compare.cost_ratios({t.instance_id: t.costs() for t in baseline},
                                {t.instance_id: t.costs() for t in candidate}, paired_ids)
    decision = compare.promotion_decision(paired, policy, costs=costs)
    excluded = compare.excluded_tasks(baseline, candidate)
    notes = (["excluded from the pairs: " + "; ".join(f"{e.instance_id} ({e.reason})" for e in excluded)]
             if excluded else [])
    markdown = compare.render_markdown(report_a, report_b, paired, label_a, label_b, costs=costs,
                                       decision=decision, notes=notes)
    return compare.CanaryComparison(report_a=report_a, report_b=report_b, paired=paired, decision=decision,
                                    costs=costs, markdown=markdown, excluded=excluded)
