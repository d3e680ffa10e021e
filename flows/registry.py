"""Registry flows: migrate images between registries, audit a target's coverage, rewrite recorded
references, plan the sharded prewarm. Thin: they resolve blocks and inputs, map the tasks of
``tasks/registry_ops.py`` and publish artifacts.

Entry points (``prefect.yaml`` deployments are registered by the lead):

* ``flows/registry.py:migrate_images`` (flow ``migrate-images``)
* ``flows/registry.py:registry_audit`` (flow ``registry-audit``)
* ``flows/registry.py:rewrite_image_refs`` (flow ``rewrite-image-refs``)
* ``flows/registry.py:prewarm_plan`` (flow ``prewarm-plan``)
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger, unmapped
from prefect.artifacts import create_image_artifact
from prefect.runtime import flow_run
from pydantic import BaseModel, ConfigDict

from blocks.core import RegistryEndpoint
from forgeflow import migrate
from forgeflow.errors import InputError
from forgeflow.layout import PrewarmPlan
from forgeflow.settings import apply_container_env, home_dir
from forgeflow.store import Store
from tasks import registry_ops
from tasks.common import markdown_artifact, table_artifact


class MigrationSummary(BaseModel):
    """What ``migrate-images`` did: one record per image, the target's coverage, the state file."""

    model_config = ConfigDict(frozen=True)

    records: list[migrate.MigrationRecord]
    coverage: migrate.CoverageReport
    state_path: str


def _endpoint(value: str | RegistryEndpoint, what: str) -> RegistryEndpoint:
    if isinstance(value, RegistryEndpoint):
        return value
    if isinstance(value, dict):
        return RegistryEndpoint(**value)
    try:
        return RegistryEndpoint.load(value)
    except ValueError as err:
        raise InputError(f"{what} registry block {value!r} is not saved: {err}") from err


def _names(images: list[str] | None, dataset_path: Path | None, image_column: str) -> list[str]:
    if (images is None) == (dataset_path is None):
        raise InputError("give exactly one of images (repo:tag names) or dataset_path (a JSONL file)")
    if dataset_path is not None:
        return migrate.image_names_from_jsonl(dataset_path, image_column)
    names = list(dict.fromkeys(images or []))
    if not names:
        raise InputError("images is empty")
    return names


def _coverage_rows(report: migrate.CoverageReport) -> list[dict]:
    return [{"ref": r.ref, "availability": r.availability, "digest": r.digest or "",
             "error_type": r.error_type or ""} for r in report.rows]


def _publish_coverage(key: str, report: migrate.CoverageReport, target: RegistryEndpoint) -> None:
    table_artifact(key, _coverage_rows(report) + [
        {"ref": "TOTAL", "availability": f"available {report.available} / missing {report.missing} / "
                                         f"errored {report.errored} of {report.total}", "digest": "",
         "error_type": ""}], f"Coverage of {report.total} images in {target.address}")


@flow(name="migrate-images", log_prints=True)
def migrate_images(source: str | RegistryEndpoint, target: str | RegistryEndpoint,
                   images: list[str] | None = None, dataset_path: Path | None = None,
                   image_column: str = "image", max_size_bytes: int = 2_000_000_000,
                   concurrency_limit: int = 4, rate_limit_per_s: float | None = None,
                   state_path: Path | None = None, store_url: str | None = None) -> MigrationSummary:
    """Copy images source -> target (``--all --preserve-digests``, digests verified), one task each.

    Each image is a ``migrate-<name>`` task under the target registry's global concurrency limit
    (``concurrency_limit`` slots, created/updated here) and optional rate limit; transient registry
    errors are retried by Prefect, a missing image or an auth failure is ``failed`` at once. Every
    image's state goes to the store's ``images`` table (role ``target``: digest once completed)
    and, with reason and exception type, to the state file. A re-run copies only what the target
    does not serve yet. Artifacts: ``migrate-images`` (state and digests per image) and
    ``migrate-coverage`` (available / missing / errored in the target).

    Args:
        source / target: A saved ``forgeflow-registry`` block name or a RegistryEndpoint.
        images: ``repo:tag`` names; or ``dataset_path``: a JSONL file with an ``image_column``.
        max_size_bytes: Images above this (sum of compressed layers) are skipped (``oversize``).
        concurrency_limit: Concurrent images against the target registry.
        rate_limit_per_s: Images started per second (None: no rate limit).
        state_path: State file (default ``$FORGEFLOW_HOME/registry/migrate-<target>.json``).
        store_url: Store URL (default ``settings.store_url()``).

    Raises:
        InputError: bad inputs (nothing is copied then).
    """
    apply_container_env()
    log = get_run_logger()
    src, dst = _endpoint(source, "source"), _endpoint(target, "target")
    names = _names(images, dataset_path, image_column)
    if max_size_bytes < 0:
        raise InputError(f"max_size_bytes must be >= 0, got {max_size_bytes}")
    registry_ops.image_refs(src, names)  # validates every name before anything runs
    state_file = Path(state_path or home_dir() / "registry" / f"migrate-{registry_ops.limit_name(dst.address)}.json")
    store = Store(store_url)
    store.upgrade()
    run_id = flow_run.get_id()
    pending = [migrate.MigrationRecord(source_ref=s, target_ref=t, status="pending")
               for s, t in zip(registry_ops.image_refs(src, names), registry_ops.image_refs(dst, names))]
    migrate.record_pending(store, pending, run_id)
    done = {ref for ref, r in migrate.load_states(state_file).items() if r.status == "completed"}
    migrate.save_states(state_file, [r for r in pending if r.target_ref not in done])
    limit, rate = registry_ops.ensure_registry_limits(dst.address, concurrency_limit, rate_limit_per_s)
    futures = registry_ops.migrate_one.map(names, unmapped(src), unmapped(dst), unmapped(max_size_bytes),
                                           unmapped(limit), unmapped(rate), unmapped(store.url), unmapped(run_id))
    records = []
    for name, base, future in zip(names, pending, futures):
        future.wait()
        state = future.state
        if state.is_completed():
            records.append(future.result())
        else:
            err = state.result(raise_on_failure=False)
            records.append(base.model_copy(update={
                "status": "failed", "reason": str(err), "error_type": type(err).__name__}))
            log.warning("%s failed: %s: %s", name, type(err).__name__, err)
    migrate.save_states(state_file, records)
    copied = sum(r.status == "completed" and r.reason != "already present" for r in records)
    table_artifact("migrate-images", [
        {"image": n, "status": r.status, "reason": r.reason, "error_type": r.error_type or "",
         "source_digest": r.source_digest or "", "target_digest": r.target_digest or "",
         "size_bytes": r.size_bytes, "copied": r.status == "completed" and r.reason != "already present"}
        for n, r in zip(names, records)], f"{len(records)} images {src.address} -> {dst.address}, {copied} copied")
    report = registry_ops.coverage_check(dst, names)
    _publish_coverage("migrate-coverage", report, dst)
    return MigrationSummary(records=records, coverage=report, state_path=str(state_file))


@flow(name="registry-audit", log_prints=True)
def registry_audit(target: str | RegistryEndpoint, images: list[str] | None = None,
                   dataset_path: Path | None = None, image_column: str = "image") -> migrate.CoverageReport:
    """Coverage of a dataset's images (or a list) in a registry: available / missing / errored,
    published as the ``registry-coverage`` table artifact."""
    apply_container_env()
    dst = _endpoint(target, "target")
    report = registry_ops.coverage_check(dst, _names(images, dataset_path, image_column))
    _publish_coverage("registry-coverage", report, dst)
    return report


@flow(name="rewrite-image-refs", log_prints=True)
def rewrite_image_refs(old_prefix: str, new_prefix: str, dry_run: bool = True,
                       store_url: str | None = None) -> migrate.RewritePlan:
    """Rewrite recorded image references (``images.ref``, ``task_instances.image_ref``) from one
    registry prefix to another in one transaction; ``dry_run`` only publishes the diff
    (``rewrite-image-refs`` table artifact). Reverse it with the prefixes swapped."""
    plan = registry_ops.rewrite_refs(old_prefix, new_prefix, dry_run, store_url)
    table_artifact("rewrite-image-refs", [r.model_dump() for r in plan.rows],
                   f"{'dry run: ' if dry_run else ''}{len(plan.rows)} references {old_prefix} -> {new_prefix}")
    return plan


@flow(name="prewarm-plan", log_prints=True)
def prewarm_plan(tasks_path: Path | None = None, shards: int = 80, lanes: int = 5, prefix: str = "task",
                 tag_cap: int = 100, plot_path: Path | None = None,
                 store_url: str | None = None) -> PrewarmPlan:
    """Plan the ``base-sharded-tags`` layout and check it against the tag cap; copies nothing.

    Tasks come from ``tasks_path`` (JSONL with ``task_id`` and ``base_digest``) or, without it, from
    the store (each task's base = its repository's target image). Publishes the ``prewarm-plan``
    table (projected tags per repository) and the histogram PNG (``prewarm-plan-histogram``;
    written to ``plot_path``, default ``$FORGEFLOW_HOME/registry/prewarm-plan.png``) BEFORE the check.

    Raises:
        PlanRejectedError: a repository would exceed ``tag_cap`` (names repositories and counts).
        InputError: bad inputs.
    """
    if tasks_path is not None:
        pairs = migrate.plan_tasks_from_jsonl(tasks_path)
    else:
        store = Store(store_url)
        store.upgrade()
        pairs = migrate.plan_tasks_from_store(store)
    if not pairs:
        raise InputError("no tasks to plan")
    plan = registry_ops.layout_plan(pairs, shards, lanes, prefix, tag_cap)
    table_artifact("prewarm-plan", [
        {"repository": repo, "projected_tags": n, "basecache_tags": len(plan.basecache.get(repo, {})),
         "cap": tag_cap, "over_cap": repo in plan.rejected_repositories}
        for repo, n in sorted(plan.projected_tag_counts.items())],
        f"{len(pairs)} tasks over {len(plan.projected_tag_counts)} repositories")
    png = registry_ops.tag_histogram(plan, Path(plot_path or home_dir() / "registry" / "prewarm-plan.png"))
    uri = png.resolve().as_uri()
    try:
        create_image_artifact(image_url=uri, key="prewarm-plan-histogram",
                              description="Projected tags per repository")
    except Exception as err:  # noqa: BLE001 - fall back to a link, the plot file exists either way
        get_run_logger().warning("image artifact refused %s (%s); publishing a link", uri, err)
        markdown_artifact("prewarm-plan-histogram", f"![projected tags per repository]({uri})\n\n{png}",
                          "Projected tags per repository")
    return plan.check()
