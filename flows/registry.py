"""Registry flows: migrate images, audit a target's coverage, rewrite recorded references, plan the prewarm.

Also the registries of a lifecycle run (:func:`registry_blocks`, :func:`run_registries`). The params models'
defaults are the deployments' (the demo's loopback registries ``127.0.0.1:5701`` / ``:5702``, 80 shards).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Annotated

from prefect import flow, get_run_logger, unmapped
from prefect.artifacts import create_image_artifact
from prefect.runtime import flow_run
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from blocks.core import RegistryEndpoint
from flows.stagekit import StageParams, run_task
from forgeflow.common.errors import InputError, MigrationIncompleteError, validation_problems
from forgeflow.common.settings import apply_container_env, home_dir
from forgeflow.common.settings import store_url as default_store_url
from forgeflow.config import RegistrySettings
from forgeflow.registry import auth as registry_auth
from forgeflow.registry import coverage, imageref
from forgeflow.registry import migration as migrate
from forgeflow.registry.layout import MAX_SHARDS, PREFIX_PATTERN, PrewarmPlan, ShardLayout, shard_layout
from forgeflow.registry.server import RegistryServer
from tasks import registry as registry_ops
from tasks.common import markdown_artifact, table_artifact


class MigrationSummary(BaseModel):
    """What ``migrate-images`` did."""

    model_config = ConfigDict(frozen=True)

    records: list[migrate.MigrationRecord] = Field(description="one record per image, input order")
    coverage: coverage.CoverageReport  # the target's coverage afterwards, beside the recorded states
    copied: int = Field(description="images copied by this run")
    failed: list[str] = Field(description="'<name>: <ExceptionType>: <message>' per failed image, input order")


_DEMO_REGISTRIES = RegistrySettings()
"""The demo's embedded loopback registries (source ``127.0.0.1:5701``, target ``127.0.0.1:5702``)."""

_DEFAULT_LAYOUT = ShardLayout()
"""The default shard layout (80 ``task-NN`` repositories, 5 lanes, 100 tags each)."""

_ENDPOINT_FORMS = ("a saved forgeflow-registry block name, or an endpoint {address: host[:port], namespace, "
                   "username, password, tls_verify}")
_IMAGES_TEXT = ("image names repo:tag[@sha256:<64 hex>] relative to the registry, or full references whose host is "
                "the registry's address; give exactly one of images or dataset_path")


class ImageSelection(StageParams):
    """The images a registry flow works on: ``images``, or the ``image_column`` of ``dataset_path``."""

    images: tuple[str, ...] | None = Field(None, description=_IMAGES_TEXT)
    dataset_path: Path | None = Field(None, description="a JSONL file whose image_column holds the image names; "
                                                        "None: images")
    image_column: str = Field("image", min_length=1, description="the dataset_path column holding the image names")


class MigrateParams(ImageSelection):
    """The ``migrate-images`` flow's parameters (the migrate deployment's defaults are the model's)."""

    source: str | RegistryEndpoint = Field(RegistryEndpoint(address=_DEMO_REGISTRIES.source_address),
                                           description=f"the registry copied from: {_ENDPOINT_FORMS}; default "
                                                       f"the demo's source {_DEMO_REGISTRIES.source_address}")
    target: str | RegistryEndpoint = Field(RegistryEndpoint(address=_DEMO_REGISTRIES.target_address),
                                           description=f"the registry copied into: {_ENDPOINT_FORMS}; default "
                                                       f"the demo's target {_DEMO_REGISTRIES.target_address}")
    transfer: migrate.TransferLimits = Field(
        migrate.TransferLimits(), description="max_size_bytes (larger images are skipped, bytes), concurrency_limit "
                                              "(images at once against the target, 1-64), rate_limit_per_s (images "
                                              "started per second; None: no limit), retry_delays_s (seconds before "
                                              "each retry of a transient failure, at most 10; None: the default)")
    store_url: str | None = Field(None, description="the store's SQLAlchemy URL; None: $FORGEFLOW_STORE_URL or "
                                                    "$FORGEFLOW_HOME/store.db")


class RegistryAuditParams(ImageSelection):
    """The ``registry-audit`` flow's parameters."""

    target: str | RegistryEndpoint = Field(RegistryEndpoint(address=_DEMO_REGISTRIES.target_address),
                                           description=f"the registry audited: {_ENDPOINT_FORMS}; default "
                                                       f"the demo's target {_DEMO_REGISTRIES.target_address}")
    store_url: str | None = Field(None, description="the store's SQLAlchemy URL: recorded states beside the "
                                                    "registry's, contradicted rows put back to pending; None: the "
                                                    "registry only")


RegistryPrefix = Annotated[str, AfterValidator(coverage.registry_prefix)]
"""``host[:port][/path]`` without a trailing ``/`` (:func:`forgeflow.registry.coverage.registry_prefix`)."""


class RewriteImageRefsParams(StageParams):
    """The ``rewrite-image-refs`` flow's parameters."""

    old_prefix: RegistryPrefix = Field(description="host[:port][/path] the recorded image references start with "
                                                   "now, matched at a name boundary (e.g. 127.0.0.1:5702/task-01)")
    new_prefix: RegistryPrefix = Field(description="host[:port][/path] that replaces old_prefix")
    dry_run: bool = Field(True, description="only publish the diff (the rewrite-image-refs table); False: rewrite "
                                            "in one transaction")
    store_url: str | None = Field(None, description="the store's SQLAlchemy URL; None: $FORGEFLOW_STORE_URL or "
                                                    "$FORGEFLOW_HOME/store.db")

    @model_validator(mode="after")
    def _apart(self) -> "RewriteImageRefsParams":
        coverage.check_apart(self.old_prefix, self.new_prefix)  # InputError (a ValueError) names both fields
        return self


class PrewarmPlanParams(StageParams):
    """The ``prewarm-plan`` flow's parameters."""

    tasks_path: Path | None = Field(None, description="a JSONL file of task_id and base_digest rows; None: the "
                                                      "store's recorded tasks")
    shards: int = Field(_DEFAULT_LAYOUT.shards, ge=1, le=MAX_SHARDS,
                        description=f"task repositories (<prefix>-00 ..), 1-{MAX_SHARDS}")
    lanes: int = Field(_DEFAULT_LAYOUT.lanes, ge=1, description="neighbouring shards one base's tasks spread over, "
                                                                "1..shards")
    prefix: str = Field(_DEFAULT_LAYOUT.prefix, pattern=PREFIX_PATTERN,
                        description="the repositories' name prefix: lower-case [a-z0-9] parts joined by '.', '_' or "
                                    "'-', '/' between namespace components (task gives task-00 ..)")
    tag_cap: int = Field(_DEFAULT_LAYOUT.tag_cap, ge=1, description="most tags a repository may hold (task tags + "
                                                                    "basecache tags)")
    plot_path: Path | None = Field(None, description="where the histogram PNG is written; None: "
                                                     "$FORGEFLOW_HOME/registry/prewarm-plan.png")
    store_url: str | None = Field(None, description="the store's SQLAlchemy URL, read without tasks_path; None: "
                                                    "$FORGEFLOW_STORE_URL or $FORGEFLOW_HOME/store.db")


def registry_endpoint(value: str | RegistryEndpoint, what: str) -> RegistryEndpoint:
    """The endpoint of a flow parameter, checked (InputError naming ``<what>.address``/``.namespace``)."""
    if isinstance(value, RegistryEndpoint):
        endpoint = value
    elif isinstance(value, dict):
        try:
            endpoint = RegistryEndpoint(**value)
        except ValidationError as err:
            raise InputError(f"{what} registry: {validation_problems(err)}") from None
    else:
        try:
            endpoint = RegistryEndpoint.load(value)
        except ValidationError as err:
            raise InputError(f"{what} registry block {value!r} holds bad fields: {validation_problems(err)}") from None
        except ValueError as err:
            raise InputError(f"{what} registry block {value!r} is not saved: {err}") from err
    imageref.check_address(endpoint.address, f"{what}.address")
    imageref.check_namespace(endpoint.namespace, f"{what}.namespace")
    return endpoint


def _check_limits(limits: migrate.TransferLimits) -> None:
    """The limits checked again (``model_copy(update=...)`` skips bounds); InputError names the field."""
    concurrency_limit, rate_limit_per_s = limits.concurrency_limit, limits.rate_limit_per_s
    max_size_bytes, retry_delays_s = limits.max_size_bytes, limits.retry_delays_s
    if max_size_bytes < 0:
        raise InputError(f"params.transfer.max_size_bytes must be >= 0, got {max_size_bytes}")
    if retry_delays_s is not None and (len(retry_delays_s) > 10 or any(d < 0 for d in retry_delays_s)):
        raise InputError(f"params.transfer.retry_delays_s must be at most 10 non-negative delays, got {retry_delays_s}")
    if isinstance(concurrency_limit, bool) or not isinstance(concurrency_limit, int) \
            or not 1 <= concurrency_limit <= 64:
        raise InputError(f"params.transfer.concurrency_limit must be a whole number of images in 1-64, "
                         f"got {concurrency_limit!r}")
    if rate_limit_per_s is not None and not rate_limit_per_s > 0:
        raise InputError(f"params.transfer.rate_limit_per_s must be a positive number of images per second (or None: "
                         f"no rate limit), got {rate_limit_per_s!r}")


def _names(images: tuple[str, ...] | None) -> list[str] | None:
    return None if images is None else list(images)


def _failure_message(names: list[str], records: list[migrate.MigrationRecord]) -> str:
    failed = [(name, r) for name, r in zip(names, records) if r.status == "failed"]
    by_type = Counter(r.error_type or "Exception" for _, r in failed)
    kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(by_type.items(), key=lambda kv: (-kv[1], kv[0])))
    shown = ", ".join(f"{name} ({r.error_type})" for name, r in failed[:5])
    more = f" and {len(failed) - 5} more" if len(failed) > 5 else ""
    return (f"{len(failed)} of {len(records)} images failed ({kinds}): {shown}{more}; each image's state "
            "is in the store and the migrate-images table")


def _coverage_rows(report: coverage.CoverageReport) -> list[dict]:
    return [{"ref": r.ref, "availability": r.availability, "digest": r.digest or "",
             "error_type": r.error_type or "", "recorded_status": r.recorded_status or "",
             "drift": r.drift} for r in report.rows]


def _publish_coverage(key: str, report: coverage.CoverageReport, target: RegistryEndpoint) -> None:
    table_artifact(key, _coverage_rows(report) + [
        {"ref": "TOTAL", "availability": f"available {report.available} / missing {report.missing} / "
                                         f"errored {report.errored} of {report.total}", "digest": "",
         "error_type": "", "recorded_status": "", "drift": f"{report.drifted} drifted"}],
        f"Coverage of {report.total} images in {target.address}")


def _run_count(task_run_id: object) -> int:
    """How many times a task run ran (1 + retries taken), from the Prefect API."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_task_run(task_run_id).run_count


@flow(name="migrate-images", log_prints=True)
def migrate_images(params: MigrateParams = MigrateParams()) -> MigrationSummary:
    """Copy images source -> target (``--all --preserve-digests``, digests verified), one task each.

    Each image's state lives in the store's ``images`` table. An image recorded ``completed`` from the same
    source is not copied again while the target serves its digest. Copies share the target registry's global
    concurrency limit; a transient error (429, 5xx, timeout) is retried with backoff, a missing image or an
    auth failure fails at once. A name whose first component is a registry host (docker reference grammar)
    is a full reference when the host is the source's or target's address, refused otherwise.

    Args:
        params: the source and target registries, the images (a list or a dataset column), the transfer limits.

    Raises:
        InputError: bad inputs (nothing is copied or recorded then).
        RegistryUnavailableError: a registry does not answer ``GET /v2/`` (nothing copied or recorded).
        MigrationIncompleteError: some images failed, after every state and artifact was written; its
            ``summary`` holds the :class:`MigrationSummary` (``oversize`` skips do not fail the run).
    """
    apply_container_env()
    log = get_run_logger()
    src, dst = registry_endpoint(params.source, "params.source"), registry_endpoint(params.target, "params.target")
    names = registry_ops.image_names(_names(params.images), params.dataset_path, params.image_column,
                                     [(dst.address, dst.namespace), (src.address, src.namespace)], "params.")
    limits = params.transfer
    _check_limits(limits)
    max_size_bytes, retry_delays_s = limits.max_size_bytes, limits.retry_delays_s
    concurrency_limit, rate_limit_per_s = limits.concurrency_limit, limits.rate_limit_per_s
    pairs = list(zip(registry_ops.image_refs(src, names), registry_ops.image_refs(dst, names, pin_digest=False)))
    migrate.check_pairs(pairs)
    registry_ops.registries_answer({"source": src, "target": dst})
    limit, rate = registry_ops.ensure_registry_limits(dst.address, concurrency_limit, rate_limit_per_s)
    store_url = params.store_url or default_store_url()
    run_id = str(flow_run.get_id() or "") or None
    recorded = registry_ops.recorded_migrations(store_url, pairs)
    done: dict[str, migrate.MigrationRecord] = {}
    if recorded:  # the registry is the truth: a completed row counts only if the target serves it
        names_of = {dst_ref: name for name, (_, dst_ref) in zip(names, pairs)}
        check = registry_ops.coverage_check(dst, [names_of[ref] for ref in recorded])
        done = {row.ref: recorded[row.ref].model_copy(update={"reason": migrate.ALREADY_COMPLETED})
                for row in check.rows if row.digest is not None and row.digest == recorded[row.ref].target_digest}
    todo = [(name, pair) for name, pair in zip(names, pairs) if pair[1] not in done]
    registry_ops.record_pending(store_url, migrate.pending_records([pair for _, pair in todo]), run_id)
    task = registry_ops.migrate_one
    if retry_delays_s is not None:
        task = task.with_options(retries=len(retry_delays_s), retry_delay_seconds=list(retry_delays_s))
    futures = task.map([name for name, _ in todo], unmapped(src), unmapped(dst), unmapped(max_size_bytes),
                       unmapped(limit), unmapped(rate), unmapped(store_url), unmapped(run_id))
    by_target = dict(done)
    for (name, (src_ref, dst_ref)), future in zip(todo, futures):
        future.wait()
        state = future.state
        if state.is_completed():
            by_target[dst_ref] = future.result()
            continue
        err = state.result(raise_on_failure=False)
        stored = registry_ops.failed_migration(store_url, src_ref, dst_ref, str(err), type(err).__name__, run_id)
        by_target[dst_ref] = stored.model_copy(update={"attempts": _run_count(future.task_run_id)})
    records = [by_target[dst_ref] for _, dst_ref in pairs]
    failed = [f"{name}: {r.error_type}: {r.reason}" for name, r in zip(names, records) if r.status == "failed"]
    for line in failed:
        log.warning("failed: %s", line)
    copied = sum(r.status == "completed" and r.reason == "" for r in records)
    table_artifact("migrate-images", [
        {"image": n, "status": r.status, "reason": r.reason, "error_type": r.error_type or "",
         "attempts": r.attempts, "source_digest": r.source_digest or "",
         "target_digest": r.target_digest or "", "size_bytes": r.size_bytes,
         "copied": r.status == "completed" and r.reason == ""}
        for n, r in zip(names, records)], f"{len(records)} images {src.address} -> {dst.address}, "
                                          f"{copied} copied, {len(failed)} failed")
    report = registry_ops.coverage_check(dst, names, store_url)
    reset = registry_ops.reconcile(store_url, report, run_id)
    if reset:
        log.warning("the target contradicts the recorded state of %d images, put back to pending: %s",
                    len(reset), reset[:10])
    _publish_coverage("migrate-coverage", report, dst)
    summary = MigrationSummary(records=records, coverage=report, copied=copied, failed=failed)
    if failed:
        raise MigrationIncompleteError(_failure_message(names, records), summary)
    return summary


@flow(name="registry-audit", log_prints=True)
def registry_audit(params: RegistryAuditParams = RegistryAuditParams()) -> coverage.CoverageReport:
    """Coverage of a dataset's images (or a list) in a registry: available / missing / errored.

    With ``params.store_url``, rows the registry contradicts (a ``completed`` image missing or serving
    another digest) are put back to ``pending`` in one transaction, so the next migration copies them.

    Args:
        params: the registry to audit, the images (a list or a dataset column), a store URL to record them.

    Raises:
        InputError: bad inputs (nothing is checked or recorded then).
        RegistryUnavailableError: the target does not answer ``GET /v2/`` (200 or 401).
    """
    apply_container_env()
    dst, store_url = registry_endpoint(params.target, "params.target"), params.store_url
    names = registry_ops.image_names(_names(params.images), params.dataset_path, params.image_column,
                                     [(dst.address, dst.namespace)], "params.")
    registry_ops.image_refs(dst, names)
    registry_ops.registries_answer({"target": dst})
    report = registry_ops.coverage_check(dst, names, store_url)
    if store_url is not None:
        reset = registry_ops.reconcile(store_url, report, str(flow_run.get_id() or "") or None)
        if reset:
            get_run_logger().warning("put back to pending (the registry contradicts the store): %s", reset[:10])
    _publish_coverage("registry-coverage", report, dst)
    return report


@flow(name="rewrite-image-refs", log_prints=True)
def rewrite_image_refs(params: RewriteImageRefsParams) -> coverage.RewritePlan:
    """Rewrite recorded image references from ``old_prefix`` to ``new_prefix`` in one transaction.

    A prefix matches at a name boundary (``<prefix>/...``, and ``<prefix>:tag`` / ``<prefix>@digest`` for a
    repository). Reverse it with the prefixes swapped.

    Args:
        params: the image prefix to replace, its replacement, and whether to only report (dry run).

    Raises:
        InputError: recorded references already lie under ``new_prefix`` (a prefix that is not
            ``host[:port][/path]``, or prefixes that are equal or nest, are refused when ``params`` is validated).
    """
    old_prefix, new_prefix, dry_run = params.old_prefix, params.new_prefix, params.dry_run
    plan = registry_ops.rewrite_refs(old_prefix, new_prefix, dry_run, params.store_url)
    if not plan.rows:
        seen = (f"recorded references look like {plan.unmatched_example!r}" if plan.unmatched_example
                else "no image references are recorded in the store")
        get_run_logger().warning("nothing to rewrite: no recorded reference lies under old_prefix %r "
                                 "(followed by '/', or ':'/'@' after a repository); %s", plan.old_prefix, seen)
    table_artifact("rewrite-image-refs", [r.model_dump() for r in plan.rows],
                   f"{'dry run: ' if dry_run else ''}{len(plan.rows)} references {old_prefix} -> {new_prefix}")
    return plan


@flow(name="prewarm-plan", log_prints=True)
def prewarm_plan(params: PrewarmPlanParams = PrewarmPlanParams()) -> PrewarmPlan:
    """Plan the ``base-sharded-tags`` layout and check it against the tag cap; copies nothing.

    The table and histogram are published BEFORE the check, so a rejected plan still shows.

    Args:
        params: the task rows to plan, the shard, lane and tag-cap sizes, and where the plot goes.

    Raises:
        PlanRejectedError: a repository would exceed ``params.tag_cap`` (names repositories and counts).
        InputError: ``params.lanes`` exceeds ``params.shards``, or no task to plan.
    """
    shards, lanes, prefix, tag_cap = params.shards, params.lanes, params.prefix, params.tag_cap
    if lanes > shards:
        raise InputError(f"params.lanes ({lanes}) must not exceed params.shards ({shards})")
    shard_layout(shards, lanes, prefix, tag_cap)
    pairs = registry_ops.plan_tasks(params.tasks_path, params.store_url or default_store_url())
    if not pairs:
        raise InputError("no tasks to plan")
    # run_task: inside a lifecycle stage the plan is counted (cached on a re-run of the same tasks)
    plan = run_task(registry_ops.layout_plan, pairs, shards, lanes, prefix, tag_cap)
    table_artifact("prewarm-plan", [
        {"repository": repo, "projected_tags": n, "basecache_tags": len(plan.basecache.get(repo, {})),
         "cap": tag_cap, "over_cap": repo in plan.rejected_repositories}
        for repo, n in sorted(plan.projected_tag_counts.items())],
        f"{len(pairs)} tasks over {len(plan.projected_tag_counts)} repositories")
    png = registry_ops.tag_histogram(plan, Path(params.plot_path or home_dir() / "registry" / "prewarm-plan.png"))
    uri = png.resolve().as_uri()
    try:
        create_image_artifact(image_url=uri, key="prewarm-plan-histogram",
                              description="Projected tags per repository")
    except Exception as err:  # noqa: BLE001 - fall back to a link, the plot file exists either way
        get_run_logger().warning("image artifact refused %s (%s); publishing a link", uri, err)
        markdown_artifact("prewarm-plan-histogram", f"![projected tags per repository]({uri})\n\n{png}",
                          "Projected tags per repository")
    return plan.check()


def registry_blocks(settings: RegistrySettings) -> dict[str, RegistryEndpoint]:
    """The team's registries of a lifecycle run by role (``source``/``target``), from their blocks.

    Raises:
        InputError: a block is not saved, holds a bad address/namespace or half-set credentials (role named).
    """
    names = {"source": settings.source_block, "target": settings.target_block}
    blocks = {role: registry_endpoint(name, role) for role, name in names.items() if name is not None}
    for role, endpoint in blocks.items():
        has_password = endpoint.password is not None and bool(endpoint.password.get_secret_value())
        if bool(endpoint.username) != has_password:
            raise InputError(f"{role} registry block {names[role]!r} ({endpoint.address}): set both username and "
                             "password, or neither")
    return blocks


@contextmanager
def run_registries(settings: RegistrySettings, storage_root: Path, run_id: str,
                   blocks: dict[str, RegistryEndpoint]) -> Iterator[tuple[dict[str, RegistryEndpoint], dict[str, str]]]:
    """A lifecycle run's source and target registries: the team's blocks, or embedded loopback ones.

    Embedded registries are stopped by PID when the ``with`` ends. The blocks' credentials go into one
    containers-auth.json (mode 600) exported as ``REGISTRY_AUTH_FILE`` for the run (containers-auth.json(5));
    an auth file named before is not read meanwhile. Yields ``(endpoints, registry_ids)`` by role; a block's
    id is ``<address>/<namespace>@<run id>``, so each run pushes again (skopeo skips blobs already there).
    """
    endpoints, ids = dict(blocks), {role: f"{e.address}/{e.namespace}@{run_id}" for role, e in blocks.items()}
    ports = {"source": settings.source_port, "target": settings.target_port}
    servers = [RegistryServer(role, port, storage_root / role) for role, port in ports.items()
               if role not in blocks]
    credentials = {e.address: (e.username, e.password) for e in blocks.values() if e.username and e.password}
    with ExitStack() as stack:
        stack.callback(lambda: [server.stop() for server in servers])
        if credentials:
            path = stack.enter_context(registry_auth.authfile(credentials))
            previous = os.environ.get("REGISTRY_AUTH_FILE")
            os.environ["REGISTRY_AUTH_FILE"] = str(path)
            stack.callback(lambda: os.environ.pop("REGISTRY_AUTH_FILE", None) if previous is None
                           else os.environ.__setitem__("REGISTRY_AUTH_FILE", previous))
        for server in servers:
            ids[server.name] = registry_ops.start_registry(server.name, server.port, server.storage_dir)
            endpoints[server.name] = RegistryEndpoint(address=f"127.0.0.1:{server.port}")
        yield endpoints, ids


def repository_prefix(endpoint: RegistryEndpoint) -> str:
    """``host:port`` or ``host:port/namespace``: what this registry's repository references start with."""
    namespace = endpoint.namespace.strip("/")
    return f"{endpoint.address}/{namespace}" if namespace else endpoint.address
