"""Prefect tasks of the registry stages: registries, environment images, prewarm, push.

Migration lives in ``tasks/registry_ops.py`` (the ``migrate-images`` flow, which the lifecycle calls
as a subflow).
"""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from forgeflow import images, migrate, projects
from forgeflow.layout import PrewarmPlan
from forgeflow.registry import RegistryServer
from forgeflow.skopeo import Skopeo
from tasks.common import RESUMABLE, TRANSIENT_RETRIES, TRANSIENT_RETRY_DELAYS_S, retry_on_transient


@task(cache_policy=NO_CACHE)
def start_registry(name: str, port: int, storage_dir: Path) -> str:
    """Start (or reuse) a loopback ``docker-registry`` (stopped by the flow, by PID).

    Returns:
        the registry's instance id (:attr:`RegistryServer.instance_id`): tasks that write into
        the registry put it in their cache key, so a wiped or different registry is filled again.
    """
    server = RegistryServer(name, port, storage_dir)
    server.ensure_running()
    return server.instance_id


@task(cache_policy=RESUMABLE, retries=TRANSIENT_RETRIES, retry_delay_seconds=TRANSIENT_RETRY_DELAYS_S,
      retry_condition_fn=retry_on_transient)
def base_image() -> images.ImageRef:
    """The debootstrap base image (built once per machine, cached under FORGEFLOW_CACHE)."""
    return images.ensure_base_image()


@task(cache_policy=RESUMABLE, task_run_name="env-image-{project_name}")
def environment_image(project_name: str, base_image_id: str, work_dir: Path) -> tuple[str, str]:
    """Fetch the pinned sdist, make the checkout and build the environment image.

    Returns:
        (local image name, checkout path as str)
    """
    project = projects.get_project(project_name)
    checkout = projects.prepare_checkout(project, work_dir / "checkouts" / project.name)
    ref = images.build_env_image(project, checkout, images.BASE_IMAGE_TAG)
    return ref.name, str(checkout)


@task(cache_policy=RESUMABLE, retries=TRANSIENT_RETRIES, retry_delay_seconds=TRANSIENT_RETRY_DELAYS_S,
      retry_condition_fn=retry_on_transient, task_run_name="push-{dest}")
def push_local_image(local_name: str, local_image_id: str, dest: str, registry_id: str) -> str:
    """Push a local image (containers-storage) to ``dest`` (``host:port/repo:tag``); returns the
    registry digest (FACTS.md: the push recompresses, the registry digest is the truth).
    ``local_image_id`` and the destination's ``registry_id`` are part of the cache key."""
    return Skopeo().copy(f"containers-storage:{local_name}", f"docker://{dest}", preserve_digests=False)


@task(cache_policy=RESUMABLE, retries=TRANSIENT_RETRIES, retry_delay_seconds=TRANSIENT_RETRY_DELAYS_S,
      retry_condition_fn=retry_on_transient)
def prewarm(plan: PrewarmPlan, target_address: str, base_refs: dict[str, str],
            target_registry_id: str, concurrency: int = 5) -> list[migrate.BasecacheRecord]:
    """Check the plan against the tag cap, copy every ``basecache-*`` tag (``concurrency``
    skopeo commands at a time, 1-16) and verify its digest (``target_registry_id`` keys the
    cache: a wiped target is pre-warmed again)."""
    plan.check()
    records = migrate.prewarm_basecache(Skopeo(), plan, target_address, base_refs, max_workers=concurrency)
    migrate.verify_prewarm(Skopeo(), records, max_workers=concurrency)
    return records


@task(cache_policy=RESUMABLE, task_run_name="task-image-{instance_id}")
def task_image(env_image: str, env_image_id: str, instance_id: str, bug_patch: str) -> images.ImageRef:
    """Build the task image (environment + bug, fresh git history). ``env_image_id`` keys the cache."""
    return images.build_task_image(env_image, instance_id, bug_patch)
