"""Prefect tasks of the registry stages and flows: registries, images, push, prewarm, one image's migration,
coverage, reference rewrite, the prewarm plan and its histogram (over :mod:`forgeflow.registry`).

Per-registry limits are Prefect global concurrency limits (``registry-<host>-<port>``, optionally ``...-rate``
with slot decay), acquired with ``strict=False``: a limit deleted meanwhile lets the task proceed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.concurrency.sync import concurrency, rate_limit
from prefect.context import TaskRunContext

from blocks.core import RegistryEndpoint
from forgeflow.common import settings
from forgeflow.common.errors import InputError, is_transient
from forgeflow.common.fsutil import atomic_write_bytes, atomic_write_text
from forgeflow.registry import auth as registry_auth
from forgeflow.registry import coverage, imageref, images, projects
from forgeflow.registry import migration as migrate
from forgeflow.registry import prewarm as basecache
from forgeflow.registry.layout import PrewarmPlan, ShardLayout
from forgeflow.registry.server import RegistryServer
from forgeflow.registry.skopeo import Skopeo
from tasks.common import RESUMABLE, io_task, shared_store


@task(cache_policy=NO_CACHE)
def start_registry(name: str, port: int, storage_dir: Path) -> str:
    """Start (or reuse) a loopback ``docker-registry``; its instance id, which writers put in their cache key
    (a wiped registry is filled again)."""
    server = RegistryServer(name, port, storage_dir)
    server.ensure_running()
    return server.instance_id


@io_task(cache_policy=RESUMABLE)
def base_image() -> images.ImageRef:
    """The debootstrap base image (built once per machine, cached under FORGEFLOW_CACHE)."""
    return images.ensure_base_image()


@task(cache_policy=RESUMABLE, task_run_name="env-image-{project_name}")
def environment_image(project_name: str, base_image_id: str, work_dir: Path) -> tuple[str, str]:
    """Fetch the pinned sdist, make the checkout and build the environment image: (image name, checkout path)."""
    project = projects.get_project(project_name)
    checkout = projects.prepare_checkout(project, work_dir / "checkouts" / project.name)
    ref = images.build_env_image(project, checkout, images.BASE_IMAGE_TAG)
    return ref.name, str(checkout)


@io_task(cache_policy=RESUMABLE, task_run_name="push-{dest}")
def push_local_image(local_name: str, local_image_id: str, dest: str, registry_id: str) -> str:
    """Push a local image to ``dest`` (``host:port/repo:tag``); the registry digest (the push recompresses)."""
    return Skopeo().copy(f"containers-storage:{local_name}", f"docker://{dest}", preserve_digests=False)


@io_task(cache_policy=RESUMABLE)
def prewarm(plan: PrewarmPlan, target_address: str, base_refs: dict[str, str],
            target_registry_id: str, concurrency: int = 5) -> list[basecache.BasecacheRecord]:
    """Check the plan against the tag cap, copy every ``basecache-*`` tag (``concurrency`` at a time, 1-16) and
    verify its digest."""
    plan.check()
    records = basecache.prewarm_basecache(Skopeo(), plan, target_address, base_refs, max_workers=concurrency)
    basecache.verify_prewarm(Skopeo(), records, max_workers=concurrency)
    return records


@task(cache_policy=RESUMABLE, task_run_name="task-image-{instance_id}")
def task_image(env_image: str, env_image_id: str, instance_id: str, bug_patch: str) -> images.ImageRef:
    """Build the task image (environment + bug, fresh git history)."""
    return images.build_task_image(env_image, instance_id, bug_patch)


SKOPEO_RETRY_TIMES = 2
"""skopeo's own ``--retry-times`` inside one attempt (Prefect retries the task on top)."""


@task(cache_policy=NO_CACHE)
def local_image_id(name: str) -> str:
    """The id (``sha256:...``) of the local image ``name`` in podman's store, as it is now. Raises ImageNotFoundError:
    no local image has that name."""
    return images.image_id(name)


@io_task(task_run_name="layer-reuse-{task_ref}")
def layer_reuse(task_ref: str, base_ref: str) -> int:
    """How many layers of its base ``base_ref`` the task image ``task_ref`` starts with (both without transport). Raises
    DigestMismatchError: it does not start with the base's layers; ImageNotFoundError, RegistryError,
    RegistryUnavailableError: from skopeo (transient ones retried)."""
    return len(basecache.verify_layer_reuse(Skopeo(), f"docker://{task_ref}", f"docker://{base_ref}").base_layers)


def limit_name(address: str) -> str:
    """Name of the global concurrency limit of a registry: ``registry-<host>-<port>``."""
    return "registry-" + re.sub(r"[^A-Za-z0-9.-]", "-", address)


def ensure_registry_limits(address: str, slots: int, rate_per_s: float | None = None) -> tuple[str, str | None]:
    """Create (or update) the registry's concurrency limit (``slots``: concurrent skopeo operations, 1-64) and optional
    rate limit (``rate_per_s``: images started per second); (limit name, rate limit name or None). Raises InputError:
    ``slots`` outside 1-64 or ``rate_per_s`` not positive."""
    if not 1 <= slots <= 64:
        raise InputError(f"concurrency slots {slots} outside 1-64")
    if rate_per_s is not None and rate_per_s <= 0:
        raise InputError(f"rate_per_s must be positive, got {rate_per_s}")
    name = limit_name(address)
    rate_name = None
    with get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name(name, slots)
        if rate_per_s is not None:
            rate_name = f"{name}-rate"
            # a rate limit: slots decay at rate_per_s; the limit bounds a burst to ~1 s of rate
            client.upsert_global_concurrency_limit_by_name(
                rate_name, max(1, int(round(rate_per_s))), slot_decay_per_second=rate_per_s
            )
    return name, rate_name


@contextmanager
def skopeo_for(*endpoints: RegistryEndpoint) -> Iterator[Skopeo]:
    """A Skopeo with one temporary auth file (mode 600, deleted afterwards) of the endpoints' credentials."""
    entries = {}
    for endpoint in endpoints:
        has_password = endpoint.password is not None and bool(endpoint.password.get_secret_value())
        if bool(endpoint.username) != has_password:
            raise InputError(f"registry {endpoint.address}: set both username and password, or neither")
        if endpoint.username:
            entries[endpoint.address] = (endpoint.username, endpoint.password)
    if not entries:
        yield Skopeo(retry_times=SKOPEO_RETRY_TIMES)
        return
    with registry_auth.authfile(entries) as path:
        yield Skopeo(authfile=path, retry_times=SKOPEO_RETRY_TIMES)


def image_ref(endpoint: RegistryEndpoint, name: str, pin_digest: bool = True) -> str:
    """Transport reference of ``name`` (``repo:tag[@sha256:<hex>]`` or ``repo@sha256:<hex>``) in ``endpoint``; by digest
    when it has one and ``pin_digest`` (a source), else by tag (a target). Raises InputError: a malformed name, a name
    with a registry host, or no tag where one is needed."""
    parsed = imageref.parse_name(name)
    if parsed.host is not None:
        raise InputError(f"image {name!r} names a registry host; expected 'repo:tag' relative to {endpoint.address}")
    if pin_digest and parsed.digest:
        prefix = f"{endpoint.namespace.strip('/')}/" if endpoint.namespace else ""
        return f"docker://{endpoint.address}/{prefix}{parsed.repository}@{parsed.digest}"
    if parsed.tag is None:
        raise InputError(f"image {name!r} has no tag: a copy needs 'repo:tag' (optionally '@sha256:<hex>')")
    return endpoint.ref(parsed.repository, parsed.tag)


def image_refs(endpoint: RegistryEndpoint, names: list[str], pin_digest: bool = True) -> list[str]:
    """:func:`image_ref` of every name, in order (InputError for a bad name)."""
    return [image_ref(endpoint, name, pin_digest) for name in names]


@io_task(task_run_name="migrate-{name}")
def migrate_one(name: str, source: RegistryEndpoint, target: RegistryEndpoint, max_size_bytes: int | None,
                limit: str, rate: str | None, store_url: str | None = None,
                run_id: str | None = None) -> migrate.MigrationRecord:
    """Migrate one image (inspect, oversize skip, ``copy --all --preserve-digests``, digest check) under the target's
    limits, and write its ``images`` row (``store_url``, None: ``settings.store_url()``): ``completed`` / ``skipped``,
    ``failed`` once no retry follows, ``pending`` while a transient failure is retried. Returns the image's record
    (``attempts`` = this task run's run count). Raises ImageNotFoundError, RegistryError, RegistryUnavailableError,
    DigestMismatchError: the attempt's failure, after its state was written."""
    src, dst = image_ref(source, name), image_ref(target, name, pin_digest=False)
    context = TaskRunContext.get()
    attempt = context.task_run.run_count if context is not None else 1
    retries = context.task.retries if context is not None else 0
    store = shared_store(store_url if store_url is not None else settings.store_url())
    with concurrency(limit, occupy=1, strict=False):
        if rate:
            rate_limit(rate, occupy=1, strict=False)
        with skopeo_for(source, target) as skopeo:
            record, error = migrate.attempt_migration(skopeo, src, dst, max_size_bytes, attempt)
    if error is not None and is_transient(error) and attempt <= retries:
        migrate.record_state(store, record.model_copy(update={
            "status": "pending", "reason": f"attempt {attempt} failed, retrying: "
                                          f"{record.error_type}: {record.reason}"}), run_id)
    else:
        migrate.record_state(store, record, run_id)
    get_run_logger().info("%s: %s %s (attempt %d)", name, record.status, record.reason, attempt)
    if error is not None:
        raise error
    return record


@task(cache_policy=NO_CACHE, task_run_name="coverage-{target.address}")
def coverage_check(target: RegistryEndpoint, names: list[str], store_url: str | None = None) -> coverage.CoverageReport:
    """Which of ``names`` the target serves (available / missing / errored), beside each image's recorded
    migration state when ``store_url`` is given."""
    store = shared_store(store_url) if store_url is not None else None
    with skopeo_for(target) as skopeo:
        return coverage.coverage(skopeo, image_refs(target, names), store=store)


@task(cache_policy=NO_CACHE)
def rewrite_refs(old_prefix: str, new_prefix: str, dry_run: bool, store_url: str | None = None) -> coverage.RewritePlan:
    """Rewrite recorded image references in one transaction (``dry_run``: the diff only); ``store_url`` None:
    ``settings.store_url()``."""
    store = shared_store(store_url if store_url is not None else settings.store_url())
    return coverage.rewrite_refs(store, old_prefix, new_prefix, dry_run=dry_run)


@task(cache_policy=RESUMABLE)
def layout_plan(tasks: list[tuple[str, str]], shards: int, lanes: int, prefix: str, tag_cap: int) -> PrewarmPlan:
    """The ``base-sharded-tags`` plan of ``(task id, base digest)`` pairs, not yet checked against the cap (a pure
    function: cached). Raises InputError: a repeated task id, a malformed digest, or two tasks on one image tag (never
    cached)."""
    layout = ShardLayout(shards=shards, lanes=lanes, prefix=prefix, tag_cap=tag_cap)
    return layout.plan(tasks)


def render_tag_histogram(counts: dict[str, int], tag_cap: int, path: Path) -> Path:
    """Plot projected tags per repository (bars above ``tag_cap`` red, the cap a line) as a PNG at ``path``."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    repos = sorted(counts)
    figure = Figure(figsize=(max(6.0, 0.12 * len(repos) + 2), 4), dpi=100)
    axes = figure.subplots()
    axes.bar(range(len(repos)), [counts[r] for r in repos],
             color=["tab:red" if counts[r] > tag_cap else "tab:blue" for r in repos])
    axes.axhline(tag_cap, color="black", linestyle="--", label=f"tag cap {tag_cap}")
    axes.set_xlabel("repository")
    axes.set_ylabel("projected tags")
    axes.set_title(f"projected tags per repository ({len(repos)} repositories)")
    if len(repos) <= 40:
        axes.set_xticks(range(len(repos)), repos, rotation=90, fontsize=7)
    axes.legend()
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return atomic_write_bytes(path, buffer.getvalue())


@task(cache_policy=NO_CACHE)
def tag_histogram(plan: PrewarmPlan, path: Path) -> Path:
    """:func:`render_tag_histogram` of the plan's projected tag counts."""
    return render_tag_histogram(plan.projected_tag_counts, plan.layout.tag_cap, path)


def _fitting_columns(dataset_path: Path, image_column: str, registries: list[tuple[str, str]]) -> list[str]:
    """Columns of the dataset's first row (other than ``image_column``) whose value would be accepted."""
    from forgeflow.common.fsutil import read_jsonl_objects

    for _, row in read_jsonl_objects(dataset_path, "dataset file"):
        fitting = []
        for column, value in row.items():
            if column == image_column or not isinstance(value, str):
                continue
            try:
                imageref.relative_name(value, registries)
            except InputError:
                continue
            fitting.append(column)
        return fitting
    return []


@task(cache_policy=NO_CACHE)
def image_names(images: list[str] | None, dataset_path: Path | None, image_column: str,
                registries: list[tuple[str, str]], field_prefix: str = "") -> list[str]:
    """Distinct ``repo:tag[@sha256:...]`` names relative to ``registries`` (``(address, namespace)``), first-seen order,
    from ``images`` or the ``image_column`` of the JSONL ``dataset_path``. Raises InputError: neither or both sources,
    no name, a malformed name or one of another host (where it came from; for a dataset, the columns whose values would
    fit)."""
    if (images is None) == (dataset_path is None):
        raise InputError(f"give exactly one of {field_prefix}images (repo:tag names) or {field_prefix}dataset_path "
                         "(a JSONL file)")
    if dataset_path is not None:
        raw = coverage.image_names_from_jsonl(dataset_path, image_column)
        what = f"{field_prefix}dataset_path {dataset_path} column {image_column!r} value"
    else:
        raw = list(dict.fromkeys(images or []))
        what = f"{field_prefix}images entry"
    if not raw:
        raise InputError(f"{field_prefix}images is empty")
    try:
        names = [imageref.relative_name(name, registries, what).relative for name in raw]
    except InputError as err:
        if dataset_path is None:
            raise
        fitting = _fitting_columns(dataset_path, image_column, registries)
        hint = f" (columns of this file whose values fit: {fitting})" if fitting else ""
        raise InputError(f"{err}{hint}") from None
    return list(dict.fromkeys(names))


@task(cache_policy=NO_CACHE, task_run_name="registries-answer")
def registries_answer(endpoints: dict[str, RegistryEndpoint]) -> None:
    """Each registry (role -> endpoint) answers ``GET /v2/`` (200 or 401). Raises RegistryUnavailableError: one does not
    answer (its role and address named)."""
    for role, endpoint in endpoints.items():
        migrate.check_reachable(endpoint.address, endpoint.tls_verify, what=role)


@io_task()
def recorded_migrations(store_url: str, pairs: list[tuple[str, str]]) -> dict[str, migrate.MigrationRecord]:
    """The targets of ``(source ref, target ref)`` pairs the store records ``completed`` from that source."""
    return migrate.completed_in_store(shared_store(store_url), pairs)


@io_task()
def record_pending(store_url: str, records: list[migrate.MigrationRecord], run_id: str | None) -> int:
    """Mark each record's target ``pending`` in one transaction; the count."""
    return migrate.record_pending(shared_store(store_url), records, run_id)


@io_task()
def failed_migration(store_url: str, source_ref: str, target_ref: str, reason: str, error_type: str,
                     run_id: str | None) -> migrate.MigrationRecord:
    """The ``failed`` state of an image whose migrate task failed: the one it recorded, or, when it died before
    writing it, one recorded now with ``reason`` and ``error_type``."""
    store = shared_store(store_url)
    stored = migrate.load_states(store, [target_ref]).get(target_ref)
    if stored is None or stored.status != "failed":
        stored = migrate.MigrationRecord(source_ref=source_ref, target_ref=target_ref, status="failed",
                                         reason=reason, error_type=error_type)
        migrate.record_state(store, stored, run_id)
    return stored


@io_task()
def reconcile(store_url: str, report: coverage.CoverageReport, run_id: str | None) -> list[str]:
    """Put every ``completed`` row the registry contradicts back to ``pending`` in one transaction; the refs."""
    return coverage.reconcile_coverage(shared_store(store_url), report, run_id)


@task(cache_policy=NO_CACHE)
def write_plan_tasks(tasks: list[tuple[str, str]], path: Path) -> Path:
    """Write ``(task id, base digest)`` pairs to ``path`` as ``{"task_id", "base_digest"}`` JSONL (the
    ``prewarm-plan`` flow's ``tasks_path``), atomically; returns ``path``."""
    return atomic_write_text(path, "".join(json.dumps({"task_id": task_id, "base_digest": digest}) + "\n"
                                           for task_id, digest in tasks))


@task(cache_policy=NO_CACHE)
def plan_tasks(tasks_path: Path | None, store_url: str) -> list[tuple[str, str]]:
    """``(task id, base digest)`` pairs a prewarm plan lays out: from the JSONL ``tasks_path``, else the store's."""
    if tasks_path is not None:
        return coverage.plan_tasks_from_jsonl(tasks_path)
    return coverage.plan_tasks_from_store(shared_store(store_url))
