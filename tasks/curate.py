"""Prefect tasks of the ``curate`` flow: image availability and one NOP/Oracle validation attempt.

``validate_attempt`` differs from :func:`tasks.curation.validate_candidate` in one input: the
``run_key`` (``curate-a<N>``, N = the instance's earlier NOP trials, void ones included). It goes
into the trial ids and the cache key, so a task requeued by ``recover`` is validated afresh with
new trial ids (the voided rows stay for audit), while a killed-and-resumed batch reuses the same
key: Prefect's cache answers and the store upserts the same trial ids (nothing duplicated).
"""

from __future__ import annotations

from collections import defaultdict

from prefect import task
from prefect.cache_policies import NO_CACHE

from forgeflow import images, trial
from forgeflow.candidates import CandidateTask
from forgeflow.errors import ImageNotFoundError
from forgeflow.sandbox import SandboxSpec
from forgeflow.skopeo import Skopeo
from tasks.common import RESUMABLE, TRANSIENT_RETRY_DELAYS_S, retry_on_transient


def _registry_repo(ref: str) -> tuple[str, str] | None:
    """``host[:port]/repo:tag`` -> (``host[:port]/repo``, tag); None for local or digest refs."""
    first, _, rest = ref.partition("/")
    if not rest or "@" in ref or first == "localhost" or not ("." in first or ":" in first):
        return None
    repo, sep, tag = rest.rpartition(":")
    return (f"{first}/{repo}", tag) if sep and "/" not in tag else None


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=TRANSIENT_RETRY_DELAYS_S[:2],
      retry_condition_fn=retry_on_transient)
def available_images(refs: list[str]) -> list[str]:
    """Which image references exist, checked cheaply: one ``skopeo list-tags`` per registry
    repository (``host:port/repo:tag``); ``podman image exists`` for local names and digest refs.

    Returns:
        The existing references, sorted.

    Raises:
        RegistryUnavailableError: a registry does not answer (transient: retried).
    """
    by_repo: dict[str, set[str]] = defaultdict(set)
    local: list[str] = []
    for ref in set(refs):
        split = _registry_repo(ref)
        if split is None:
            local.append(ref)
        else:
            by_repo[split[0]].add(split[1])
    found = [ref for ref in local if images.image_exists(ref)]
    skopeo = Skopeo()
    for repo, tags in by_repo.items():
        try:
            present = set(skopeo.list_tags(f"docker://{repo}"))
        except ImageNotFoundError:
            present = set()
        found.extend(f"{repo}:{tag}" for tag in tags & present)
    return sorted(found)


@task(cache_policy=RESUMABLE, retries=2, retry_delay_seconds=TRANSIENT_RETRY_DELAYS_S[:2],
      retry_condition_fn=retry_on_transient, task_run_name="validate-{candidate.instance_id}-{run_key}")
def validate_attempt(candidate: CandidateTask, image_ref: str, test_command: str, timeout_s: float,
                     memory_mb: int, run_key: str) -> trial.ValidationOutcome:
    """NOP then Oracle of one candidate (:func:`forgeflow.trial.validate_candidate`) under ``run_key``.

    Infrastructure failures come back as trials with an exception type (never a rejection); an
    exception raised here (bad input) fails only this task run. Prefect retries transient
    infrastructure errors (the flow's ``max_retries`` overrides the count).
    """
    return trial.validate_candidate(candidate, image_ref, test_command, timeout_s=timeout_s,
                                    spec=SandboxSpec(memory_mb=memory_mb), run_key=run_key)
