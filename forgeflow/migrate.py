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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.errors import (
    DigestMismatchError,
    ForgeflowError,
    ImageNotFoundError,
    InputError,
    is_transient,
)
from forgeflow.layout import PrewarmPlan
from forgeflow.skopeo import Skopeo

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
