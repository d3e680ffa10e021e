"""Migrate images between registries and pre-warm basecache tags, verifying every digest.

A migration copies with ``--all --preserve-digests``, so the target serves byte-identical
manifests: the target digest must equal the source digest, else :class:`DigestMismatchError`.
A pre-warm copies each base image under its ``basecache-<12 hex>`` tag into every task
repository that a :class:`~forgeflow.layout.PrewarmPlan` puts tasks built on it in.

Both are idempotent: an image already present with the right digest is not copied again.

:func:`migrate_images` migrates a list and records a state per image (completed / skipped /
failed with the exception's type and message) without stopping at the first failure; transient
registry errors (429, 5xx, timeouts, refused connections) are retried with exponential backoff,
auth failures and missing images are not. :func:`verify_layer_reuse` checks that a task image was
built on its base (its layers start with the base's layers), so a pull finds them pre-warmed.

For the registry flows (``flows/registry.py``): :func:`image_names_from_jsonl` (a dataset's image
column), :func:`record_pending` / :func:`record_state` (per-image state in the store's ``images``
table, role ``target``) with :func:`save_states` / :func:`load_states` (the full state: reason,
exception type, both digests), :func:`coverage` (available / missing / errored in a registry),
:func:`rewrite_refs` (move recorded references between registry prefixes in one reversible
transaction, with a dry-run diff) and the prewarm plan inputs :func:`plan_tasks_from_jsonl` /
:func:`plan_tasks_from_store`.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select, update

from forgeflow.errors import (
    DigestMismatchError,
    ForgeflowError,
    ImageNotFoundError,
    InputError,
    is_transient,
)
from forgeflow.fsutil import atomic_write_json, read_jsonl_objects
from forgeflow.layout import PrewarmPlan
from forgeflow.skopeo import Skopeo
from forgeflow.store import Image, ImageRecord, ImageRole, Store, TaskInstance

MigrationStatus = Literal["pending", "completed", "skipped", "failed"]


class MigrationRecord(BaseModel):
    """The outcome of migrating one image.

    Attributes:
        source_ref: Source transport reference.
        target_ref: Target transport reference.
        source_digest: ``sha256:<hex>`` of the source manifest/index.
        target_digest: Digest the target serves (None when skipped or failed before copying).
        status: ``pending`` (not attempted yet), ``completed`` (copied or already present),
            ``skipped`` (e.g. ``oversize``) or ``failed`` (an exception was recorded).
        reason: Why skipped/failed (for ``failed``: the exception's message), or
            ``already present``; empty for a fresh copy.
        size_bytes: Sum of compressed layer sizes of the source.
        error_type: Class name of the exception of a ``failed`` record
            (``RegistryUnavailableError``, ``ImageNotFoundError``...), else None.
        attempts: skopeo attempts made for this image (retries of transient errors included).
    """

    model_config = ConfigDict(frozen=True)

    source_ref: str
    target_ref: str
    source_digest: str | None = None
    target_digest: str | None = None
    status: MigrationStatus
    reason: str = ""
    size_bytes: int | None = Field(default=None, ge=0)
    error_type: str | None = None
    attempts: int = Field(default=0, ge=0)


class LayerReuse(BaseModel):
    """Evidence that a task image reuses its base image's layers.

    Attributes:
        task_ref: The task image reference checked.
        base_ref: The base image reference checked.
        base_layers: Layer digests of the base image, bottom first.
        task_layers: Layer digests of the task image, bottom first.
        reused: True: ``task_layers`` starts with ``base_layers``.
    """

    model_config = ConfigDict(frozen=True)

    task_ref: str
    base_ref: str
    base_layers: list[str]
    task_layers: list[str]
    reused: bool


class BasecacheRecord(BaseModel):
    """One basecache tag written into one task repository.

    Attributes:
        repository: Task repository name (``task-07``).
        tag: ``basecache-<12 hex>``.
        base_digest: The base image's digest (the tag must serve exactly this).
        source_ref: Where the base was copied from.
        target_ref: ``docker://<target>/<repository>:<tag>``.
        target_digest: Digest the target reported after the copy.
        copied: False if the tag already served ``base_digest`` and nothing was copied.
    """

    model_config = ConfigDict(frozen=True)

    repository: str
    tag: str
    base_digest: str
    source_ref: str
    target_ref: str
    target_digest: str
    copied: bool


def _digest_or_none(skopeo: Skopeo, ref: str) -> str | None:
    try:
        return skopeo.inspect_digest(ref)
    except ImageNotFoundError:
        return None


def migrate_image(
    skopeo: Skopeo,
    source_ref: str,
    target_ref: str,
    max_size_bytes: int | None = None,
) -> MigrationRecord:
    """Copy one image (all platforms) from ``source_ref`` to ``target_ref`` keeping its digest.

    Steps: inspect the source digest and size; skip with reason ``oversize`` if the size
    exceeds ``max_size_bytes``; if the target already serves the source digest, record
    ``already present``; else ``copy --all --preserve-digests``; re-inspect the target.

    Args:
        skopeo: The skopeo wrapper.
        source_ref: e.g. ``docker://127.0.0.1:5701/env/six:1.16.0``.
        target_ref: e.g. ``docker://127.0.0.1:5702/env/six:1.16.0``.
        max_size_bytes: Largest image (sum of compressed layers) to migrate; None = no limit.

    Returns:
        A :class:`MigrationRecord` with status ``completed`` or ``skipped``.

    Raises:
        InputError: ``max_size_bytes`` is negative.
        ImageNotFoundError: the source image does not exist (the message names it).
        DigestMismatchError: the target serves a different digest after the copy.
        RegistryError, RegistryUnavailableError, ToolMissingError: from skopeo.
    """
    if max_size_bytes is not None and max_size_bytes < 0:
        raise InputError(f"max_size_bytes must be >= 0, got {max_size_bytes}")
    return _migrate(skopeo, source_ref, target_ref, max_size_bytes, {})


def _migrate(
    skopeo: Skopeo,
    source_ref: str,
    target_ref: str,
    max_size_bytes: int | None,
    seen: dict[str, object],
) -> MigrationRecord:
    """:func:`migrate_image`'s steps; ``seen`` collects the source digest and size as soon as
    they are known, so a failure later on can still record them."""
    source_digest = skopeo.inspect_digest(source_ref)
    seen["source_digest"] = source_digest
    size = skopeo.size_bytes(source_ref)
    seen["size_bytes"] = size
    if max_size_bytes is not None and size > max_size_bytes:
        return MigrationRecord(
            source_ref=source_ref,
            target_ref=target_ref,
            source_digest=source_digest,
            status="skipped",
            reason=f"oversize: {size} bytes > max {max_size_bytes} bytes",
            size_bytes=size,
        )
    if _digest_or_none(skopeo, target_ref) == source_digest:
        return MigrationRecord(
            source_ref=source_ref,
            target_ref=target_ref,
            source_digest=source_digest,
            target_digest=source_digest,
            status="completed",
            reason="already present",
            size_bytes=size,
        )
    skopeo.copy(source_ref, target_ref, all_images=True, preserve_digests=True)
    target_digest = skopeo.inspect_digest(target_ref)
    seen["target_digest"] = target_digest
    if target_digest != source_digest:
        raise DigestMismatchError(
            f"{target_ref} serves {target_digest} after copying {source_ref} ({source_digest})"
        )
    return MigrationRecord(
        source_ref=source_ref,
        target_ref=target_ref,
        source_digest=source_digest,
        target_digest=target_digest,
        status="completed",
        size_bytes=size,
    )


def pending_records(pairs: Sequence[tuple[str, str]]) -> list[MigrationRecord]:
    """The initial state of a migration: one ``pending`` record per (source, target) pair."""
    return [MigrationRecord(source_ref=src, target_ref=dst, status="pending") for src, dst in pairs]


def migrate_images(
    skopeo: Skopeo,
    pairs: Sequence[tuple[str, str]],
    max_size_bytes: int | None = None,
    *,
    transient_retries: int = 2,
    backoff_s: float = 1.0,
    on_record: Callable[[MigrationRecord], None] | None = None,
) -> list[MigrationRecord]:
    """Migrate every (source, target) pair in order, recording a state per image.

    Each image goes through :func:`migrate_image` (inspect, oversize skip, already-present
    check, ``copy --all --preserve-digests``, digest verification). A failure does not stop the
    list: it becomes a ``failed`` record with the exception's class name and message. A
    transient failure (:func:`forgeflow.errors.is_transient`: 429, 5xx, timeouts, refused
    connections) is retried up to ``transient_retries`` times, waiting ``backoff_s * 2**k``
    seconds before retry ``k`` (exponential backoff); auth failures (:class:`RegistryError`),
    missing images (:class:`ImageNotFoundError`) and digest mismatches are not retried.

    Re-running with the same pairs copies nothing that is completed: the target already serves
    the source digest, which is recorded as ``completed`` / ``already present`` (the registry
    is the source of truth, not a previous record).

    Args:
        skopeo: The skopeo wrapper (its own ``retry_times`` also applies inside each copy).
        pairs: (source transport reference, target transport reference), targets unique.
        max_size_bytes: Largest image to migrate (sum of compressed layers); None = no limit.
        transient_retries: Retries of a transiently failing image (0-10).
        backoff_s: Base of the exponential backoff in seconds (>= 0).
        on_record: Called with each image's final record as soon as it is known (e.g. to
            persist progress); an exception it raises propagates.

    Returns:
        One record per pair, in input order; status ``completed``, ``skipped`` or ``failed``.

    Raises:
        InputError: bad arguments or repeated targets (nothing is copied then).
    """
    if max_size_bytes is not None and max_size_bytes < 0:
        raise InputError(f"max_size_bytes must be >= 0, got {max_size_bytes}")
    if not 0 <= transient_retries <= 10:
        raise InputError(f"transient_retries {transient_retries} is outside 0-10")
    if backoff_s < 0:
        raise InputError(f"backoff_s must be >= 0, got {backoff_s}")
    targets = [dst for _, dst in pairs]
    repeated = sorted({dst for dst in targets if targets.count(dst) > 1})
    if repeated:
        raise InputError(f"target references repeated in the migration: {repeated}")
    records = []
    for source_ref, target_ref in pairs:
        attempt = 0
        while True:
            attempt += 1
            seen: dict[str, object] = {}
            try:
                record = _migrate(skopeo, source_ref, target_ref, max_size_bytes, seen)
                record = record.model_copy(update={"attempts": attempt})
                break
            except ForgeflowError as err:
                if is_transient(err) and attempt <= transient_retries:
                    time.sleep(backoff_s * 2 ** (attempt - 1))
                    continue
                record = MigrationRecord(
                    source_ref=source_ref,
                    target_ref=target_ref,
                    source_digest=seen.get("source_digest"),
                    target_digest=seen.get("target_digest"),
                    size_bytes=seen.get("size_bytes"),
                    status="failed",
                    reason=str(err),
                    error_type=type(err).__name__,
                    attempts=attempt,
                )
                break
        records.append(record)
        if on_record is not None:
            on_record(record)
    return records


def verify_layer_reuse(skopeo: Skopeo, task_ref: str, base_ref: str) -> LayerReuse:
    """Check that the task image's layers start with the base image's layers.

    That is what makes a pre-warmed ``basecache`` tag useful: a task image built ``FROM`` its
    base (and pushed so that the base layers keep their digests) shares the base's blobs, so a
    pull transfers only the task's own layers. For an index, the ``linux/<this machine's
    architecture>`` manifest is compared (:meth:`Skopeo.layers`).

    Args:
        skopeo: The skopeo wrapper.
        task_ref: Transport reference of the task image.
        base_ref: Transport reference of its base image.

    Returns:
        A :class:`LayerReuse` with ``reused=True``.

    Raises:
        DigestMismatchError: the task image does not start with the base's layers (names both
            references and the first differing position).
        ImageNotFoundError, RegistryError, RegistryUnavailableError, ToolMissingError: from skopeo.
    """
    base_layers = skopeo.layers(base_ref)
    task_layers = skopeo.layers(task_ref)
    reused = bool(base_layers) and task_layers[: len(base_layers)] == base_layers
    if not reused:
        position = next(
            (i for i, (a, b) in enumerate(zip(base_layers, task_layers)) if a != b),
            min(len(base_layers), len(task_layers)),
        )
        raise DigestMismatchError(
            f"task image {task_ref} does not reuse the layers of base {base_ref}: "
            f"{len(base_layers)} base layers, {len(task_layers)} task layers, first difference "
            f"at layer {position}"
        )
    return LayerReuse(
        task_ref=task_ref,
        base_ref=base_ref,
        base_layers=base_layers,
        task_layers=task_layers,
        reused=True,
    )


def prewarm_basecache(
    skopeo: Skopeo,
    plan: PrewarmPlan,
    target_address: str,
    base_refs: dict[str, str],
    max_workers: int = 4,
) -> list[BasecacheRecord]:
    """Copy every planned basecache tag into its task repository (digests preserved).

    The plan is checked against its tag cap first. Copies run ``max_workers`` at a time
    (skopeo: 80 tags one by one 12.7 s, 8 at a time 5.5 s; shared/FACTS.md). A tag that already
    serves its base digest is not copied again.

    Args:
        skopeo: The skopeo wrapper.
        plan: A :class:`PrewarmPlan` from :meth:`ShardLayout.plan`.
        target_address: ``host:port`` of the target registry (``127.0.0.1:5702``).
        base_refs: base digest -> transport reference of that base image in the target registry
            (e.g. ``docker://127.0.0.1:5702/base/debian:bookworm``); must cover every base in
            the plan.
        max_workers: Parallel copies (1-16).

    Returns:
        One :class:`BasecacheRecord` per (repository, tag), sorted by repository then tag.

    Raises:
        PlanRejectedError: a repository would exceed the tag cap.
        InputError: a base digest of the plan has no entry in ``base_refs``, or bad arguments.
        ImageNotFoundError: a base reference does not exist.
        DigestMismatchError: a base reference does not serve its digest, or a copy changed it.
        RegistryError, RegistryUnavailableError, ToolMissingError: from skopeo.
    """
    plan.check()
    if not target_address or "/" in target_address:
        raise InputError(f"target_address must be host:port, got {target_address!r}")
    if not 1 <= max_workers <= 16:
        raise InputError(f"max_workers {max_workers} is outside 1-16")
    needed = {digest for tags in plan.basecache.values() for digest in tags.values()}
    missing = sorted(needed - base_refs.keys())
    if missing:
        raise InputError(f"base_refs has no source reference for base digests: {missing}")
    for digest in sorted(needed):
        served = skopeo.inspect_digest(base_refs[digest])
        if served != digest:
            raise DigestMismatchError(
                f"base reference {base_refs[digest]} serves {served}, not the planned {digest}"
            )
    jobs = [
        (repo, tag, digest)
        for repo, tags in sorted(plan.basecache.items())
        for tag, digest in sorted(tags.items())
    ]

    def _one(job: tuple[str, str, str]) -> BasecacheRecord:
        repo, tag, digest = job
        target_ref = f"docker://{target_address}/{repo}:{tag}"
        present = _digest_or_none(skopeo, target_ref) == digest
        written = digest if present else skopeo.copy(
            base_refs[digest], target_ref, all_images=True, preserve_digests=True
        )
        return BasecacheRecord(
            repository=repo,
            tag=tag,
            base_digest=digest,
            source_ref=base_refs[digest],
            target_ref=target_ref,
            target_digest=written,
            copied=not present,
        )

    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        return list(pool.map(_one, jobs))


def verify_prewarm(skopeo: Skopeo, records: list[BasecacheRecord]) -> None:
    """Check that every basecache tag serves exactly its base digest.

    Raises:
        DigestMismatchError: naming each tag that serves another digest.
        ImageNotFoundError: a basecache tag is missing.
        RegistryError, RegistryUnavailableError, ToolMissingError: from skopeo.
    """
    wrong = []
    for record in records:
        served = skopeo.inspect_digest(record.target_ref)
        if served != record.base_digest:
            wrong.append(f"{record.target_ref} serves {served}, expected {record.base_digest}")
    if wrong:
        raise DigestMismatchError("basecache tags with the wrong digest: " + "; ".join(wrong))


# --- image lists, per-image state, coverage, reference rewrite ----------------------------------
# (added for the registry flows: flows/registry.py)

ImageAvailability = Literal["available", "missing", "errored"]

REWRITE_IMAGE_ROLES: tuple[str, ...] = ("task", "env", "basecache")
"""Image roles whose references :func:`rewrite_refs` moves by default. ``source`` and ``target``
rows are the migration's own record of both sides and stay where they are."""


def image_names_from_jsonl(path: str | Path, column: str = "image") -> list[str]:
    """The image names (``repo:tag``) of a dataset's JSONL file, first occurrence order.

    Args:
        path: A JSON-lines file, one object per line (blank lines ignored).
        column: The field holding the image name.

    Returns:
        Distinct non-empty names in the order they first appear.

    Raises:
        InputError: the file is missing, a line is not a JSON object, or a row lacks ``column``
            (the message names the file and line number).
    """
    names: dict[str, None] = {}
    for number, row in read_jsonl_objects(path, "dataset file"):
        if not isinstance(row.get(column), str) or not row[column]:
            raise InputError(f"{path}:{number} has no non-empty string column {column!r}")
        names.setdefault(row[column], None)
    return list(names)


def store_ref(transport_ref: str) -> str:
    """The store's form of an image reference: the transport reference without ``docker://``."""
    return transport_ref.removeprefix("docker://")


def record_state(store: Store, record: MigrationRecord, run_id: str | None = None) -> None:
    """Record one image's migration state in the store's ``images`` table (role ``target``).

    The row's ``digest`` is the verified target digest for a ``completed`` record and NULL
    otherwise (pending / skipped / failed: not in the target). The reason and exception type live
    in the migration's state document (:func:`save_states`): ``images`` has no status column.

    Args:
        store: The store (upgraded).
        record: The image's record.
        run_id: The Prefect run id that produced it.
    """
    completed = record.status == "completed"
    store.record_image(
        ImageRecord(
            ref=store_ref(record.target_ref),
            digest=record.target_digest if completed else None,
            role="target",
            size_bytes=record.size_bytes,
            run_id=run_id,
        )
    )


def record_pending(store: Store, records: Sequence[MigrationRecord], run_id: str | None = None) -> int:
    """Insert a ``pending`` target row (digest NULL) for each record that has no row yet.

    Rows that exist (completed or not) are left as they are, so a re-run never erases a completed
    digest. Returns the number of rows inserted; all are written in one transaction.
    """
    rows = [
        ({"ref": store_ref(r.target_ref)}, {"digest": None, "role": "target", "run_id": run_id})
        for r in records
        if store.get_image(store_ref(r.target_ref)) is None
    ]
    if rows:
        store.upsert_many(Image, rows)
    return len(rows)


def save_states(path: str | Path, records: Sequence[MigrationRecord]) -> Path:
    """Write every image's state (status, reason, exception type, both digests) atomically.

    The document is ``{"schema_version": 1, "records": {target_ref: record}}`` merged over the
    file's earlier content, so states of images not in ``records`` are kept.

    Returns:
        The path written.
    """
    merged = {r.target_ref: r for r in load_states(path).values()}
    merged.update({r.target_ref: r for r in records})
    document = {
        "schema_version": 1,
        "records": {ref: rec.model_dump(mode="json") for ref, rec in sorted(merged.items())},
    }
    return atomic_write_json(path, document)


def load_states(path: str | Path) -> dict[str, MigrationRecord]:
    """The states :func:`save_states` wrote, by target reference; empty if there is no file.

    Raises:
        InputError: the file exists but is not a state document.
    """
    source = Path(path)
    if not source.exists():
        return {}
    try:
        document = json.loads(source.read_text(encoding="utf-8"))
        return {ref: MigrationRecord.model_validate(r) for ref, r in document["records"].items()}
    except (ValueError, KeyError, TypeError) as err:
        raise InputError(f"{source} is not a migration state document: {err}") from err


class AvailabilityRow(BaseModel):
    """Whether one image is in the target registry.

    Attributes:
        ref: Transport reference checked.
        availability: ``available`` (the registry serves a manifest), ``missing`` (it answers
            "not found") or ``errored`` (it could not say: unavailable, auth, ...).
        digest: The served digest when available.
        error_type: Exception class name when errored.
        error: Exception message when errored.
    """

    model_config = ConfigDict(frozen=True)

    ref: str
    availability: ImageAvailability
    digest: str | None = None
    error_type: str | None = None
    error: str = ""


class CoverageReport(BaseModel):
    """How much of an image list a registry serves.

    Attributes:
        total: Images checked.
        available / missing / errored: Counts per :data:`ImageAvailability`.
        rows: One row per image, input order.
    """

    model_config = ConfigDict(frozen=True)

    total: int = Field(ge=0)
    available: int = Field(ge=0)
    missing: int = Field(ge=0)
    errored: int = Field(ge=0)
    rows: list[AvailabilityRow]


def coverage(skopeo: Skopeo, refs: Sequence[str], max_workers: int = 4) -> CoverageReport:
    """Check which of ``refs`` the registry serves (``skopeo inspect --raw``, in parallel).

    An infrastructure failure of one image is an ``errored`` row, not an exception: the report
    says how much could not be checked.

    Args:
        skopeo: The skopeo wrapper (with credentials for the registry).
        refs: Transport references (``docker://host:port/repo:tag``).
        max_workers: Parallel inspections (1-16).

    Returns:
        A :class:`CoverageReport`.

    Raises:
        InputError: bad ``max_workers``.
    """
    if not 1 <= max_workers <= 16:
        raise InputError(f"max_workers {max_workers} is outside 1-16")

    def _one(ref: str) -> AvailabilityRow:
        try:
            return AvailabilityRow(ref=ref, availability="available", digest=skopeo.inspect_digest(ref))
        except ImageNotFoundError:
            return AvailabilityRow(ref=ref, availability="missing")
        except ForgeflowError as err:
            return AvailabilityRow(
                ref=ref, availability="errored", error_type=type(err).__name__, error=str(err)
            )

    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        rows = list(pool.map(_one, refs))
    counts = Counter(row.availability for row in rows)
    return CoverageReport(
        total=len(rows),
        available=counts["available"],
        missing=counts["missing"],
        errored=counts["errored"],
        rows=rows,
    )


class RewriteRow(BaseModel):
    """One reference a rewrite changes.

    Attributes:
        table: ``images`` or ``task_instances``.
        key: The row's natural key (``images.ref`` before the change, or the instance id).
        column: ``ref`` or ``image_ref``.
        old: The reference before.
        new: The reference after.
    """

    model_config = ConfigDict(frozen=True)

    table: Literal["images", "task_instances"]
    key: str
    column: Literal["ref", "image_ref"]
    old: str
    new: str


class RewritePlan(BaseModel):
    """The diff of a reference rewrite and whether it was applied.

    Attributes:
        old_prefix / new_prefix: As given.
        image_roles: Image roles whose ``images.ref`` rows were in scope.
        rows: Every change, sorted by table then key.
        applied: False for a dry run.
    """

    model_config = ConfigDict(frozen=True)

    old_prefix: str
    new_prefix: str
    image_roles: tuple[str, ...]
    rows: list[RewriteRow]
    applied: bool


_PREFIX = re.compile(r"[A-Za-z0-9.-]+(?::\d{1,5})?(?:/[A-Za-z0-9._-]+)*")


def _under(ref: str, prefix: str) -> bool:
    return ref.startswith(prefix + "/")


def rewrite_refs(
    store: Store,
    old_prefix: str,
    new_prefix: str,
    dry_run: bool = True,
    *,
    image_roles: Sequence[str] = REWRITE_IMAGE_ROLES,
) -> RewritePlan:
    """Move recorded image references from one registry prefix to another, in ONE transaction.

    ``images.ref`` (rows whose role is in ``image_roles``) and ``task_instances.image_ref`` that
    lie under ``old_prefix`` (``<old_prefix>/...``, a path-segment boundary) get ``new_prefix``
    instead. The plan is computed and checked inside the same transaction that applies it.

    Reversible: the rewrite is refused while any in-scope reference already lies under
    ``new_prefix`` (those would be moved back too, or collide with a moved ``images`` key), so
    ``rewrite_refs(store, new_prefix, old_prefix, dry_run=False)`` restores exactly what was
    there.

    Args:
        store: The store (upgraded).
        old_prefix: ``host[:port][/path]`` the references start with now (``127.0.0.1:5701``).
        new_prefix: ``host[:port][/path]`` they should start with.
        dry_run: Only compute the diff (nothing is written).
        image_roles: Roles of ``images`` rows in scope (default :data:`REWRITE_IMAGE_ROLES`).

    Returns:
        A :class:`RewritePlan` with every change (``applied`` False on a dry run).

    Raises:
        InputError: a prefix is not ``host[:port][/path]``, the prefixes are equal or one
            contains the other, an unknown role is named, or in-scope references already lie
            under ``new_prefix`` (the message names up to 10). Nothing is written then.
    """
    old_prefix, new_prefix = old_prefix.rstrip("/"), new_prefix.rstrip("/")
    for name, value in (("old_prefix", old_prefix), ("new_prefix", new_prefix)):
        if not _PREFIX.fullmatch(value):
            raise InputError(f"{name} {value!r} is not host[:port][/path]")
    if old_prefix == new_prefix or _under(old_prefix, new_prefix) or _under(new_prefix, old_prefix):
        raise InputError(
            f"old_prefix {old_prefix!r} and new_prefix {new_prefix!r} must not contain each other"
        )
    roles = tuple(image_roles)
    unknown = sorted(set(roles) - set(ImageRole.__args__))
    if unknown:
        raise InputError(f"unknown image roles {unknown}; valid: {list(ImageRole.__args__)}")
    with store.session() as session:
        images = session.execute(
            select(Image.ref).where(Image.role.in_(roles)).order_by(Image.ref)
        ).scalars().all()
        tasks = session.execute(
            select(TaskInstance.instance_id, TaskInstance.image_ref)
            .where(TaskInstance.image_ref.is_not(None))
            .order_by(TaskInstance.instance_id)
        ).all()
        every_ref = set(session.execute(select(Image.ref)).scalars())
        blocking = sorted(
            {ref for ref in images if _under(ref, new_prefix)}
            | {ref for _, ref in tasks if _under(ref, new_prefix)}
        )
        moved = {ref: new_prefix + ref[len(old_prefix):] for ref in images if _under(ref, old_prefix)}
        blocking += sorted(new for new in moved.values() if new in every_ref and new not in blocking)
        if blocking:
            raise InputError(
                f"cannot rewrite {old_prefix} -> {new_prefix} reversibly: {len(blocking)} recorded "
                f"references already lie under {new_prefix}: {blocking[:10]}"
            )
        rows = [
            RewriteRow(table="images", key=old, column="ref", old=old, new=new)
            for old, new in sorted(moved.items())
        ] + [
            RewriteRow(
                table="task_instances", key=instance_id, column="image_ref", old=ref,
                new=new_prefix + ref[len(old_prefix):],
            )
            for instance_id, ref in tasks
            if _under(ref, old_prefix)
        ]
        if not dry_run:
            now = datetime.now(UTC)
            for row in rows:
                if row.table == "images":
                    session.execute(
                        update(Image).where(Image.ref == row.old).values(ref=row.new, updated_at=now)
                    )
                else:
                    session.execute(
                        update(TaskInstance)
                        .where(TaskInstance.instance_id == row.key)
                        .values(image_ref=row.new, updated_at=now)
                    )
    return RewritePlan(
        old_prefix=old_prefix, new_prefix=new_prefix, image_roles=roles, rows=rows,
        applied=not dry_run,
    )


def plan_tasks_from_jsonl(
    path: str | Path, id_column: str = "task_id", digest_column: str = "base_digest"
) -> list[tuple[str, str]]:
    """``(task_id, base_digest)`` pairs of a JSONL file, for :meth:`ShardLayout.plan`.

    Raises:
        InputError: missing file, a line that is not a JSON object, or a row without both
            columns as non-empty strings (file and line number named).
    """
    pairs = []
    for number, row in read_jsonl_objects(path, "task file"):
        values = [row.get(c) for c in (id_column, digest_column)]
        if not all(isinstance(v, str) and v for v in values):
            raise InputError(f"{path}:{number} needs string columns {id_column!r} and {digest_column!r}")
        pairs.append((values[0], values[1]))
    return pairs


def plan_tasks_from_store(store: Store) -> list[tuple[str, str]]:
    """``(instance_id, base digest)`` of every recorded task: the base is the ``target`` image of
    the task's repository (``images.project == task_instances.repo``), as the lifecycle records it.

    Raises:
        InputError: a task's repository has no target image with a digest, or several with
            different digests (names up to 10 repositories).
    """
    digests: dict[str, set[str]] = {}
    for image in store.images(role="target"):
        if image.project and image.digest:
            digests.setdefault(image.project, set()).add(image.digest)
    tasks = store.tasks()
    unknown = sorted({t.repo for t in tasks if len(digests.get(t.repo, ())) != 1})
    if unknown:
        raise InputError(
            f"repositories without exactly one target image digest in the store: {unknown[:10]}"
        )
    return [(t.instance_id, next(iter(digests[t.repo]))) for t in tasks]
