"""Migrate images between registries and pre-warm basecache tags, verifying every digest.

A migration copies with ``--all --preserve-digests``, so the target serves byte-identical
manifests: the target digest must equal the source digest, else :class:`DigestMismatchError`.
A pre-warm copies each base image under its ``basecache-<12 hex>`` tag into every task
repository that a :class:`~forgeflow.layout.PrewarmPlan` puts tasks built on it in.

Both are idempotent: an image already present with the right digest is not copied again.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.errors import DigestMismatchError, ImageNotFoundError, InputError
from forgeflow.layout import PrewarmPlan
from forgeflow.skopeo import Skopeo

MigrationStatus = Literal["completed", "skipped", "failed"]


class MigrationRecord(BaseModel):
    """The outcome of migrating one image.

    Attributes:
        source_ref: Source transport reference.
        target_ref: Target transport reference.
        source_digest: ``sha256:<hex>`` of the source manifest/index.
        target_digest: Digest the target serves (None when skipped or failed before copying).
        status: ``completed`` (copied or already present), ``skipped`` (e.g. ``oversize``) or
            ``failed`` (set by callers that record an exception per item instead of raising).
        reason: Why skipped/failed, or ``already present``; empty for a fresh copy.
        size_bytes: Sum of compressed layer sizes of the source.
    """

    model_config = ConfigDict(frozen=True)

    source_ref: str
    target_ref: str
    source_digest: str | None = None
    target_digest: str | None = None
    status: MigrationStatus
    reason: str = ""
    size_bytes: int | None = Field(default=None, ge=0)


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
    source_digest = skopeo.inspect_digest(source_ref)
    size = skopeo.size_bytes(source_ref)
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
