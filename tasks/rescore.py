"""Prefect tasks of the ``rescore`` flow (``flows/rescore.py``): the plan read from the store and the trajectory
files, and one standing trial re-verified in a fresh sandbox (:mod:`forgeflow.evaluation.rescore`)."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from forgeflow.common import settings
from forgeflow.evaluation import rescore
from forgeflow.evaluation.agent_config import AgentConfig
from forgeflow.ledger.records import TrialRecord
from tasks.common import shared_store


@task(cache_policy=NO_CACHE, task_run_name="plan-rescore-{job_id}")
def plan_rescore(job_id: str, default_generated: Path, *, rescore_job_id: str | None = None,
                 verifier_timeout_s: float | None = None, generated_path: Path | None = None) -> rescore.RescorePlan:
    """:func:`forgeflow.evaluation.rescore.plan_rescore` on the store (``settings.store_url()``); reads only, not cached
    (the job may have gained recovery jobs). Raises InputError, PreflightError: an unknown job (its jobs listed); a task
    that cannot be re-verified."""
    return rescore.plan_rescore(shared_store(settings.store_url()), job_id, default_generated,
                                rescore_job_id=rescore_job_id, verifier_timeout_s=verifier_timeout_s,
                                generated_path=generated_path)


@task(cache_policy=NO_CACHE, task_run_name="rescore-{item.original.instance_id}")
def rescore_trial(item: rescore.RescoreItem, agent_config: AgentConfig, verifier_timeout_s: float,
                  rescore_job_id: str, run_id: str | None = None) -> TrialRecord:
    """One standing trial re-verified in a fresh sandbox, carried over or recorded missing: the new job's trial row (a
    re-run upserts the same row). Raises InputError: an unknown parser, backend or tamper policy."""
    return rescore.rescore_trial(item, agent_config, verifier_timeout_s, rescore_job_id, run_id)
