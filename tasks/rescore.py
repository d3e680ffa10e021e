"""Prefect tasks of the ``rescore`` flow (``flows/rescore.py``): the plan read from the store and the trajectory
files, and one standing trial re-verified in a fresh sandbox (:mod:`forgeflow.evaluation.rescore`)."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from forgeflow.common import settings
from forgeflow.evaluation import rescore
from tasks.common import shared_store


@task(cache_policy=NO_CACHE, task_run_name="plan-rescore-{request.job_id}")
def plan_rescore(request: rescore.RescoreRequest, default_generated: Path) -> rescore.RescorePlan:
    """:func:`forgeflow.evaluation.rescore.plan_rescore` on the store (``settings.store_url()``); reads only, not cached
    (the job may have gained recovery jobs). Raises InputError, PreflightError: an unknown job (its jobs listed); a task
    that cannot be re-verified."""
    return rescore.plan_rescore(shared_store(settings.store_url()), request, default_generated)


@task(cache_policy=NO_CACHE, task_run_name="rescore-{item.original.instance_id}")
def rescore_trial(item: rescore.RescoreItem, settings: rescore.RescoreSettings, rescore_job_id: str,
                  run_id: str | None = None) -> rescore.RescoredTrial:
    """One standing trial re-verified in a fresh sandbox, carried over or recorded missing; a re-run upserts the same
    trial row. Raises InputError: an unknown parser, backend or tamper policy."""
    return rescore.rescore_trial(item, settings, rescore_job_id, run_id)
