"""Migrate images between registries and pre-warm basecache tags, verifying every digest.

A migration copies with ``--all --preserve-digests``, so the target serves byte-identical
manifests: the target digest must equal the source digest, else :class:`DigestMismatchError`.
A pre-warm copies each base image under its ``basecache-<12 hex>`` tag into every task
repository that a :class:`~forgeflow.registry.layout.PrewarmPlan` puts tasks built on it in.

Both are idempotent: an image already present with the right digest is not copied again.

:func:`migrate_images` migrates a list and records a state per image (completed / skipped /
failed with the exception's type and message) without stopping at the first failure; transient
registry errors (429, 5xx, timeouts, refused connections) are retried with exponential backoff,
auth failures and missing images are not. :func:`attempt_migration` is one attempt with the
failure returned as data; the ``migrate-images`` flow's Prefect task (``tasks/registry.py``)
wraps it with Prefect's retries instead. :func:`verify_layer_reuse` checks that a task image was
built on its base (its layers start with the base's layers), so a pull finds them pre-warmed.

Migration state lives in the store's ``images`` table, one row per target image (role
``target``): ``status`` pending / completed / skipped / failed, ``status_reason`` (skip reason,
or ``<ExceptionType>: <message>``), ``source_ref`` / ``source_digest`` and ``digest`` (the
verified target digest of a completed image). :func:`record_pending` / :func:`record_state`
write it, :func:`load_states` / :func:`completed_in_store` read it back, so a re-run copies only
what is not completed (after checking that the target still serves the recorded digest: the
registry is the source of truth). :func:`coverage` (available / missing / errored in a
registry, beside the recorded state) and :func:`reconcile_coverage` (a completed row the
registry contradicts goes back to pending) read and write the same rows; :func:`rewrite_refs`
moves recorded references between registry prefixes in one reversible transaction, with a
dry-run diff. Also: :func:`image_names_from_jsonl` (a dataset's image column) and the prewarm
plan inputs :func:`plan_tasks_from_jsonl` / :func:`plan_tasks_from_store`.
"""

from __future__ import annotations

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

from forgeflow.common.errors import (
    DigestMismatchError,
    ForgeflowError,
    ImageNotFoundError,
    InputError,
    RegistryUnavailableError,
    is_transient,
)
from forgeflow.common.fsutil import read_jsonl_objects
from forgeflow.ledger.records import ImageRecord
from forgeflow.ledger.store import Store
from forgeflow.ledger.tables import Image, ImageRole, TaskInstance
from forgeflow.registry.layout import PrewarmPlan
from forgeflow.registry.skopeo import Skopeo

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
    source_digest, manifest = skopeo.inspect_manifest(source_ref)  # one read: digest and sizes
    seen["source_digest"] = source_digest
    size = skopeo.size_bytes(source_ref, manifest=manifest)
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


def attempt_migration(
    skopeo: Skopeo,
    source_ref: str,
    target_ref: str,
    max_size_bytes: int | None = None,
    attempts: int = 1,
) -> tuple[MigrationRecord, ForgeflowError | None]:
    """One attempt of :func:`migrate_image` that returns a failure as data instead of raising.

    Shared by :func:`migrate_images` (its own retry loop) and the Prefect task of the
    ``migrate-images`` flow (Prefect's retries), so both record the same state.

    Args:
        skopeo: The skopeo wrapper.
        source_ref / target_ref: Transport references.
        max_size_bytes: Largest image to migrate; None = no limit.
        attempts: The attempt number this is (1 = first), copied into the record.

    Returns:
        ``(record, None)`` with status ``completed`` or ``skipped``; or ``(record, error)`` with
        status ``failed``: the record holds whatever was learnt before the failure (source
        digest, size), the exception's class name as ``error_type`` and its message as
        ``reason``; the caller decides whether to retry (:func:`forgeflow.common.errors.is_transient`).

    Raises:
        InputError: ``max_size_bytes`` is negative (bad input is not an image's failure).
    """
    if max_size_bytes is not None and max_size_bytes < 0:
        raise InputError(f"max_size_bytes must be >= 0, got {max_size_bytes}")
    seen: dict[str, object] = {}
    try:
        record = _migrate(skopeo, source_ref, target_ref, max_size_bytes, seen)
        return record.model_copy(update={"attempts": attempts}), None
    except InputError:
        raise
    except ForgeflowError as err:
        return MigrationRecord(
            source_ref=source_ref,
            target_ref=target_ref,
            source_digest=seen.get("source_digest"),
            target_digest=seen.get("target_digest"),
            size_bytes=seen.get("size_bytes"),
            status="failed",
            reason=str(err),
            error_type=type(err).__name__,
            attempts=attempts,
        ), err


def migrate_images(
    skopeo: Skopeo,
    pairs: Sequence[tuple[str, str]],
    max_size_bytes: int | None = None,
    *,
    transient_retries: int = 2,
    backoff_s: float = 1.0,
    on_record: Callable[[MigrationRecord], None] | None = None,
    store: Store | None = None,
    run_id: str | None = None,
) -> list[MigrationRecord]:
    """Migrate every (source, target) pair in order, recording a state per image.

    Each image goes through :func:`attempt_migration` (inspect, oversize skip, already-present
    check, ``copy --all --preserve-digests``, digest verification). A failure does not stop the
    list: it becomes a ``failed`` record with the exception's class name and message. A
    transient failure (:func:`forgeflow.common.errors.is_transient`: 429, 5xx, timeouts, refused
    connections) is retried up to ``transient_retries`` times, waiting ``backoff_s * 2**k``
    seconds before retry ``k`` (exponential backoff); auth failures (:class:`RegistryError`),
    missing images (:class:`ImageNotFoundError`) and digest mismatches are not retried.
    (skopeo itself retries a 429 honouring ``Retry-After``, but not a 503: measured with
    skopeo 1.9.3 behind ``tests/faultproxy.py``.)

    With a ``store``, the state lives in its ``images`` table (role ``target``; see
    :func:`record_state`): images the store records as ``completed`` from the same source are
    not migrated again once the target is seen to still serve the recorded digest (record
    reason ``already completed``); every other image is marked ``pending`` first
    (:func:`record_pending`) and its final state is written as soon as it is known. So a run
    that dies half-way leaves every image ``completed``, ``skipped``, ``failed`` or still
    ``pending``, and a re-run copies only what is not completed. Without a store, an image the
    target already serves is found by inspection (reason ``already present``).

    Args:
        skopeo: The skopeo wrapper (its own ``retry_times`` also applies inside each copy).
        pairs: (source transport reference, target transport reference), targets unique.
        max_size_bytes: Largest image to migrate (sum of compressed layers); None = no limit.
        transient_retries: Retries of a transiently failing image (0-10).
        backoff_s: Base of the exponential backoff in seconds (>= 0).
        on_record: Called with each image's final record as soon as it is known (after the
            store write); an exception it raises propagates.
        store: The store holding the migration state (upgraded), or None.
        run_id: The run id stamped on the rows written.

    Returns:
        One record per pair, in input order; status ``completed``, ``skipped`` or ``failed``.

    Raises:
        InputError: bad arguments or repeated targets (nothing is copied or written then).
    """
    if max_size_bytes is not None and max_size_bytes < 0:
        raise InputError(f"max_size_bytes must be >= 0, got {max_size_bytes}")
    if not 0 <= transient_retries <= 10:
        raise InputError(f"transient_retries {transient_retries} is outside 0-10")
    if backoff_s < 0:
        raise InputError(f"backoff_s must be >= 0, got {backoff_s}")
    check_pairs(pairs)
    done: dict[str, MigrationRecord] = {}
    if store is not None:
        for target_ref, record in completed_in_store(store, pairs).items():
            if _digest_or_none_quiet(skopeo, target_ref) == record.target_digest:
                done[target_ref] = record.model_copy(update={"reason": ALREADY_COMPLETED, "attempts": 0})
        record_pending(store, [r for r in pending_records(pairs) if r.target_ref not in done], run_id)
    records = []
    for source_ref, target_ref in pairs:
        record = done.get(target_ref)
        attempt = 0
        while record is None:
            attempt += 1
            record, err = attempt_migration(skopeo, source_ref, target_ref, max_size_bytes, attempt)
            if err is not None and is_transient(err) and attempt <= transient_retries:
                time.sleep(backoff_s * 2 ** (attempt - 1))
                record = None
        if store is not None and target_ref not in done:
            record_state(store, record, run_id)
        records.append(record)
        if on_record is not None:
            on_record(record)
    return records


def check_reachable(address: str, tls_verify: bool = False, timeout_s: float = 5.0, what: str = "registry") -> str:
    """Preflight: one ``GET /v2/`` (httpx) to see that a registry answers at ``address``.

    200 or 401 (the registry asks for credentials) means reachable. With ``tls_verify`` the
    request goes to ``https://`` with certificate verification; without it (a registry skopeo
    reaches without TLS verification, often plain HTTP on loopback), plain ``http://`` is tried
    first and ``https://`` without verification after any other answer or failure.

    Args:
        address: ``host[:port]`` of the registry.
        tls_verify: The endpoint's TLS setting.
        timeout_s: Timeout of each request in seconds.
        what: How the error names the registry (``source``, ``target``).

    Returns:
        The URL that answered (``http://127.0.0.1:5702/v2/``).

    Raises:
        RegistryUnavailableError: nothing answers at ``address`` (refused, timeout, TLS failure) or
            it answers ``/v2/`` with another status than 200/401 (the message names the address).
    """
    import httpx

    schemes = [("https", True)] if tls_verify else [("http", False), ("https", False)]
    failures = []
    for scheme, verify in schemes:
        url = f"{scheme}://{address}/v2/"
        try:
            response = httpx.get(url, verify=verify, timeout=timeout_s, follow_redirects=False)
        except httpx.HTTPError as err:
            failures.append(f"{url}: {type(err).__name__}: {err}")
            continue
        if response.status_code in (200, 401):
            return url
        failures.append(f"{url}: HTTP {response.status_code}")
    raise RegistryUnavailableError(
        f"{what} registry {address} is not reachable (GET /v2/ must answer 200 or 401): "
        + "; ".join(failures)
    )


def check_pairs(pairs: Sequence[tuple[str, str]]) -> None:
    """Check a migration's (source, target) pairs: docker references, no target twice.

    Raises:
        InputError: a reference is not ``docker://`` or a target is repeated (names them).
    """
    bad = sorted({ref for pair in pairs for ref in pair if not ref.startswith("docker://")})
    if bad:
        raise InputError(f"migration references must be docker:// references: {bad[:10]}")
    counts = Counter(dst for _, dst in pairs)
    repeated = sorted(dst for dst, n in counts.items() if n > 1)
    if repeated:
        raise InputError(f"target references repeated in the migration: {repeated}")


def _digest_or_none_quiet(skopeo: Skopeo, ref: str) -> str | None:
    """The digest ``ref`` serves; None if it is missing or the registry cannot say now."""
    try:
        return skopeo.inspect_digest(ref)
    except ForgeflowError:
        return None


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
    max_workers: int = 5,
) -> list[BasecacheRecord]:
    """Copy every planned basecache tag into its task repository (digests preserved).

    The plan is checked against its tag cap first. Then, ``max_workers`` skopeo commands at a
    time: each base reference is checked to serve its planned digest and each shard
    repository's tags are listed (one ``list-tags`` per repository, not one ``inspect`` per tag:
    the 50k-task plan has ~30 basecache tags per repository); then every basecache tag the
    repository lacks, or that serves another digest, is copied. A tag that already serves its
    base digest is not copied again.

    Concurrency pays where the registry is a network away: each copy is a few sequential HTTP
    requests. Against a loopback registry on the same 2 cores the registry's own CPU bounds it
    (``python -m benchmarks.registry`` measures both).

    Args:
        skopeo: The skopeo wrapper.
        plan: A :class:`PrewarmPlan` from :meth:`ShardLayout.plan`.
        target_address: ``host:port`` of the target registry (``127.0.0.1:5702``).
        base_refs: base digest -> transport reference of that base image in the target registry
            (e.g. ``docker://127.0.0.1:5702/base/debian:bookworm``); must cover every base in
            the plan.
        max_workers: skopeo commands at a time (1-16).

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

    def _check_base(digest: str) -> None:
        served = skopeo.inspect_digest(base_refs[digest])
        if served != digest:
            raise DigestMismatchError(
                f"base reference {base_refs[digest]} serves {served}, not the planned {digest}"
            )

    def _tags_of(repo: str) -> set[str]:
        try:
            return set(skopeo.list_tags(f"docker://{target_address}/{repo}"))
        except ImageNotFoundError:  # the repository does not exist yet
            return set()

    def _one(job: tuple[str, str, str, bool]) -> BasecacheRecord:
        repo, tag, digest, listed = job
        target_ref = f"docker://{target_address}/{repo}:{tag}"
        present = listed and _digest_or_none(skopeo, target_ref) == digest
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

    repos = sorted(plan.basecache)
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        list(pool.map(_check_base, sorted(needed)))
        existing = dict(zip(repos, pool.map(_tags_of, repos), strict=True))
        jobs = [
            (repo, tag, digest, tag in existing[repo])
            for repo in repos
            for tag, digest in sorted(plan.basecache[repo].items())
        ]
        return list(pool.map(_one, jobs))


def verify_prewarm(skopeo: Skopeo, records: list[BasecacheRecord], max_workers: int = 5) -> None:
    """Check that every basecache tag serves exactly its base digest (one ``inspect --raw`` per
    tag, ``max_workers`` at a time).

    Raises:
        DigestMismatchError: naming each tag that serves another digest.
        ImageNotFoundError: a basecache tag is missing.
        InputError: ``max_workers`` outside 1-16.
        RegistryError, RegistryUnavailableError, ToolMissingError: from skopeo.
    """
    if not 1 <= max_workers <= 16:
        raise InputError(f"max_workers {max_workers} is outside 1-16")
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        served_digests = list(pool.map(lambda record: skopeo.inspect_digest(record.target_ref), records))
    wrong = []
    for record, served in zip(records, served_digests, strict=True):
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


ALREADY_COMPLETED = "already completed"
"""Reason of a record the store said was completed and the target still serves (not copied)."""

MIGRATION_COLUMNS = ("digest", "role", "size_bytes", "status", "status_reason", "source_ref",
                     "source_digest", "run_id")
"""``images`` columns a migration writes; others (``project``) are left as they are."""

_FAILED_REASON = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*): (.*)$", re.DOTALL)


def _state_values(record: MigrationRecord, run_id: str | None) -> dict[str, object]:
    completed = record.status == "completed"
    if record.status == "failed":
        reason: str | None = f"{record.error_type or 'Exception'}: {record.reason}"
    else:
        reason = record.reason or None
    return {
        "digest": record.target_digest if completed else None,
        "role": "target",
        "size_bytes": record.size_bytes,
        "status": record.status,
        "status_reason": reason,
        "source_ref": store_ref(record.source_ref),
        "source_digest": record.source_digest,
        "run_id": run_id,
    }


def record_state(store: Store, record: MigrationRecord, run_id: str | None = None) -> None:
    """Write one image's migration state into its ``images`` row (role ``target``), one upsert.

    Columns: ``status`` (pending / completed / skipped / failed), ``status_reason`` (the skip
    reason, ``already present``, or ``<ExceptionType>: <message>`` for a failure),
    ``source_ref`` / ``source_digest`` (the image copied from), ``digest`` (the verified target
    digest of a ``completed`` record, NULL otherwise), ``size_bytes``, ``run_id``. ``project``
    and ``created_at`` are kept.

    Args:
        store: The store (upgraded).
        record: The image's record.
        run_id: The Prefect run id that produced it.
    """
    store.upsert(Image, {"ref": store_ref(record.target_ref)}, _state_values(record, run_id))


def record_pending(store: Store, records: Sequence[MigrationRecord], run_id: str | None = None) -> int:
    """Mark each record's target ``pending`` (inserting rows that do not exist), in ONE transaction.

    Called for the images a run is about to attempt (not for those it found completed). The
    ``digest`` column of an existing row is not touched (it holds the last verified target
    digest until the attempt's :func:`record_state` rewrites it), nor is ``project``.

    Returns:
        The number of rows marked or inserted.
    """
    rows = []
    for record in records:
        values = _state_values(record.model_copy(update={"status": "pending", "reason": ""}), run_id)
        values.pop("digest")
        rows.append(({"ref": store_ref(record.target_ref)}, values))
    if rows:
        store.upsert_many(Image, rows)
    return len(rows)


def _as_record(image: ImageRecord) -> MigrationRecord:
    reason, error_type = image.status_reason or "", None
    if image.status == "failed":
        match = _FAILED_REASON.match(reason)
        if match:
            error_type, reason = match.group(1), match.group(2)
    return MigrationRecord(
        source_ref=f"docker://{image.source_ref}" if image.source_ref else "",
        target_ref=f"docker://{image.ref}",
        source_digest=image.source_digest,
        target_digest=image.digest,
        status=image.status or "pending",
        reason=reason,
        size_bytes=image.size_bytes,
        error_type=error_type,
    )


def load_states(store: Store, target_refs: Sequence[str] | None = None) -> dict[str, MigrationRecord]:
    """The migration state the store holds, by target transport reference.

    Args:
        store: The store (upgraded).
        target_refs: Only these targets (``docker://...``); None = every ``target`` row with a
            status.

    Returns:
        ``{target_ref: MigrationRecord}`` (``attempts`` is not stored: 0); targets without a
        row are absent.
    """
    wanted = None if target_refs is None else {store_ref(ref) for ref in target_refs}
    with store.session() as session:
        statement = select(Image).where(Image.role == "target", Image.status.is_not(None))
        if wanted is not None:
            statement = statement.where(Image.ref.in_(sorted(wanted)))
        rows = [ImageRecord.model_validate(row) for row in session.scalars(statement.order_by(Image.ref))]
    return {f"docker://{row.ref}": _as_record(row) for row in rows}


def completed_in_store(store: Store, pairs: Sequence[tuple[str, str]]) -> dict[str, MigrationRecord]:
    """Targets of ``pairs`` the store records as ``completed`` from the same source, with a digest.

    Returns:
        ``{target_ref: record}``; the caller should still check that the target serves
        ``record.target_digest`` (the registry is the source of truth).
    """
    sources = dict((dst, src) for src, dst in pairs)
    states = load_states(store, list(sources))
    return {
        ref: record for ref, record in states.items()
        if record.status == "completed" and record.target_digest
        and record.source_ref == sources[ref]
    }


class AvailabilityRow(BaseModel):
    """Whether one image is in the target registry, beside what the store records for it.

    Attributes:
        ref: Transport reference checked.
        availability: ``available`` (the registry serves a manifest), ``missing`` (it answers
            "not found") or ``errored`` (it could not say: unavailable, auth, ...).
        digest: The served digest when available.
        error_type: Exception class name when errored.
        error: Exception message when errored.
        recorded_status: The migration status of the image's ``images`` row (None: no row, or
            no store given).
        recorded_digest: The digest that row records (None if none).
        drift: Why the registry contradicts a ``completed`` row (missing, or another digest);
            empty when they agree or nothing is recorded.
    """

    model_config = ConfigDict(frozen=True)

    ref: str
    availability: ImageAvailability
    digest: str | None = None
    error_type: str | None = None
    error: str = ""
    recorded_status: str | None = None
    recorded_digest: str | None = None
    drift: str = ""


class CoverageReport(BaseModel):
    """How much of an image list a registry serves.

    Attributes:
        total: Images checked.
        available / missing / errored: Counts per :data:`ImageAvailability`.
        drifted: Rows whose ``completed`` store state the registry contradicts.
        rows: One row per image, input order.
    """

    model_config = ConfigDict(frozen=True)

    total: int = Field(ge=0)
    available: int = Field(ge=0)
    missing: int = Field(ge=0)
    errored: int = Field(ge=0)
    drifted: int = Field(default=0, ge=0)
    rows: list[AvailabilityRow]


def coverage(
    skopeo: Skopeo, refs: Sequence[str], max_workers: int = 4, store: Store | None = None
) -> CoverageReport:
    """Check which of ``refs`` the registry serves (``skopeo inspect --raw``, in parallel).

    An infrastructure failure of one image is an ``errored`` row, not an exception: the report
    says how much could not be checked. With a ``store``, each row also carries the image's
    recorded migration status and digest (its ``images`` row), and ``drift`` says where the
    registry contradicts a ``completed`` row (the registry is the source of truth:
    :func:`reconcile_coverage` puts such rows back to ``pending``).

    Args:
        skopeo: The skopeo wrapper (with credentials for the registry).
        refs: Transport references (``docker://host:port/repo:tag``).
        max_workers: Parallel inspections (1-16).
        store: The store whose ``images`` rows to compare with (upgraded), or None.

    Returns:
        A :class:`CoverageReport`.

    Raises:
        InputError: bad ``max_workers``.
    """
    if not 1 <= max_workers <= 16:
        raise InputError(f"max_workers {max_workers} is outside 1-16")
    recorded: dict[str, ImageRecord] = {}
    if store is not None:
        wanted = sorted({store_ref(ref) for ref in refs})
        with store.session() as session:
            for row in session.scalars(select(Image).where(Image.ref.in_(wanted))):
                recorded[f"docker://{row.ref}"] = ImageRecord.model_validate(row)

    def _one(ref: str) -> AvailabilityRow:
        try:
            row = AvailabilityRow(ref=ref, availability="available", digest=skopeo.inspect_digest(ref))
        except ImageNotFoundError:
            row = AvailabilityRow(ref=ref, availability="missing")
        except ForgeflowError as err:
            row = AvailabilityRow(
                ref=ref, availability="errored", error_type=type(err).__name__, error=str(err)
            )
        known = recorded.get(ref)
        if known is None:
            return row
        drift = ""
        if known.status == "completed" and row.availability == "missing":
            drift = "recorded completed, missing from the registry"
        elif known.status == "completed" and row.availability == "available" and row.digest != known.digest:
            drift = f"recorded completed with {known.digest}, the registry serves {row.digest}"
        return row.model_copy(update={"recorded_status": known.status,
                                      "recorded_digest": known.digest, "drift": drift})

    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        rows = list(pool.map(_one, refs))
    counts = Counter(row.availability for row in rows)
    return CoverageReport(
        total=len(rows),
        available=counts["available"],
        missing=counts["missing"],
        errored=counts["errored"],
        drifted=sum(bool(row.drift) for row in rows),
        rows=rows,
    )


def reconcile_coverage(store: Store, report: CoverageReport, run_id: str | None = None) -> list[str]:
    """Put every ``completed`` row the registry contradicts (``drift``) back to ``pending``.

    The row's digest is cleared and ``status_reason`` says what the coverage check saw, so the
    next migration run copies the image again. One transaction.

    Returns:
        The target references changed, input order.
    """
    changed = [row for row in report.rows if row.drift]
    if changed:
        now = datetime.now(UTC)
        with store.session() as session:
            for row in changed:
                session.execute(
                    update(Image).where(Image.ref == store_ref(row.ref)).values(
                        status="pending", digest=None, status_reason=f"coverage: {row.drift}",
                        run_id=run_id, updated_at=now)
                )
    return [row.ref for row in changed]


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
        unmatched_example: When nothing lies under ``old_prefix`` (``rows`` empty): one recorded
            in-scope reference, to show what the references look like (None when there are rows
            or nothing is recorded).
    """

    model_config = ConfigDict(frozen=True)

    old_prefix: str
    new_prefix: str
    image_roles: tuple[str, ...]
    rows: list[RewriteRow]
    applied: bool
    unmatched_example: str | None = None


_PREFIX = re.compile(r"[A-Za-z0-9.-]+(?::\d{1,5})?(?:/[A-Za-z0-9._-]+)*")


def _under(ref: str, prefix: str) -> bool:
    """``ref`` lies under ``prefix`` at a name boundary: ``prefix/...`` always; ``prefix:tag`` and
    ``prefix@digest`` when the prefix ends in a repository (it has a ``/``: after a bare host a
    ``:`` starts the port, so ``127.0.0.1`` never matches ``127.0.0.1:5702/...``)."""
    if ref.startswith(prefix + "/"):
        return True
    return "/" in prefix and ref.startswith((prefix + ":", prefix + "@"))


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
    lie under ``old_prefix`` get ``new_prefix`` instead. "Under" means at a name boundary:
    ``<old_prefix>/...``, and, for a prefix that ends in a repository
    (``127.0.0.1:5702/task-01``), also ``<old_prefix>:tag`` and ``<old_prefix>@digest``, so one
    repository moves to another (``task-01:t1`` -> ``task-02:t1``); ``task-01`` never matches
    ``task-010``. The plan is computed and checked inside the same transaction that applies it.
    When nothing matches, the plan has no rows and ``unmatched_example`` shows a recorded
    reference.

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
    example = None
    if not rows:
        example = next(iter(images), None) or next((ref for _, ref in tasks), None)
    return RewritePlan(
        old_prefix=old_prefix, new_prefix=new_prefix, image_roles=roles, rows=rows,
        applied=not dry_run, unmatched_example=example,
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
