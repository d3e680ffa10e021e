"""Prefect task of the ``curate`` flow that the lifecycle does not need: image availability.

The NOP/Oracle validation task is shared with the lifecycle: :func:`tasks.curation.validate_candidate`.
"""

from __future__ import annotations

from collections import defaultdict

from prefect import task
from prefect.cache_policies import NO_CACHE

from forgeflow import images
from forgeflow.errors import ImageNotFoundError
from forgeflow.skopeo import Skopeo
from tasks.common import TRANSIENT_RETRY_DELAYS_S, retry_on_transient


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
