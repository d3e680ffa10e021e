"""Migrate images between registries and pre-warm basecache tags, verifying every digest."""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select

from forgeflow.common.errors import (
    DigestMismatchError,
    ForgeflowError,
    InputError,
    RegistryUnavailableError,
    is_transient,
)
from forgeflow.ledger.records import ImageRecord
from forgeflow.ledger.store import Store
from forgeflow.ledger.tables import Image
from forgeflow.registry.skopeo import Skopeo, digest_or_none

MigrationStatus = Literal["pending", "completed", "skipped", "failed"]


class TransferLimits(BaseModel):
    """How hard a migration may press the registries, and which images it leaves out for size (a
    parameter group of the ``migrate-images`` flow)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_size_bytes: int = Field(2_000_000_000, ge=0, description="images above this many bytes are skipped")
    concurrency_limit: int = Field(4, ge=1, le=64, strict=True,
                                   description="images copied at once against the target registry")
    rate_limit_per_s: float | None = Field(None, gt=0, description="images started per second (None: no limit)")
    retry_delays_s: tuple[Annotated[float, Field(ge=0)], ...] | None = Field(
        None, max_length=10, description="seconds before each retry of a transient failure (None: the default)")


class MigrationRecord(BaseModel):
    """The outcome of migrating one image."""

    model_config = ConfigDict(frozen=True)

    source_ref: str = Field(description="Source transport reference.")
    target_ref: str = Field(description="Target transport reference.")
    source_digest: str | None = Field(None, description="sha256:<hex> of the source manifest/index.")
    target_digest: str | None = Field(None,
                                      description="Digest the target serves (None when skipped or failed before "
                                                  "copying).")
    status: MigrationStatus = Field(
        description="pending (not attempted yet), completed (copied or already present), skipped (e.g. "
                    "oversize) or failed (an exception was recorded).")
    reason: str = Field("",
                        description="Why skipped/failed (for failed: the exception's message), or already present; "
                                    "empty for a fresh copy.")
    size_bytes: int | None = Field(default=None, ge=0, description="Sum of compressed layer sizes of the source.")
    error_type: str | None = Field(None,
                                   description="Class name of the exception of a failed record "
                                               "(RegistryUnavailableError, ImageNotFoundError...), else None.")
    attempts: int = Field(default=0, ge=0,
                          description="skopeo attempts made for this image (retries of transient errors included).")



def migrate_image(
    skopeo: Skopeo,
    source_ref: str,
    target_ref: str,
    max_size_bytes: int | None = None,
) -> MigrationRecord:
    """Copy one image (all platforms) from ``source_ref`` to ``target_ref`` keeping its digest; the record's
    status is ``completed`` or ``skipped`` (``oversize``: above ``max_size_bytes`` of compressed layers).

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
    if digest_or_none(skopeo, target_ref) == source_digest:
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

    Returns:
        ``(record, None)``, or ``(record, error)`` with status ``failed``: what was learnt before the failure,
        ``error_type`` and ``reason``; the caller decides whether to retry.

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
    """Migrate every (source, target) pair in order, recording a state per image; a failure does not stop the list.

    A transient failure (429, 5xx, timeouts, refused connections) is retried ``transient_retries`` times after
    ``backoff_s * 2**k`` seconds; auth failures, missing images and digest mismatches are not. skopeo itself
    retries a 429 honouring ``Retry-After`` but not a 503 (measured with skopeo 1.9.3 behind
    ``tests/faultproxy.py``). With a ``store``, images recorded ``completed`` whose target still serves the
    digest are not copied again, every other one is marked ``pending`` first.

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
            if digest_or_none(skopeo, target_ref, any_error=True) == record.target_digest:
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
    """Preflight: one ``GET /v2/`` to see that a registry answers at ``address`` (200 or 401); returns the URL.

    Without ``tls_verify``, plain ``http://`` is tried first, then ``https://`` without verification.

    Raises:
        RegistryUnavailableError: nothing answers (refused, timeout, TLS failure) or ``/v2/`` answers
            another status than 200/401 (the address named).
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


# --- image lists, per-image state, coverage, reference rewrite ----------------------------------
# (added for the registry flows: flows/registry.py)


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
    """Write one image's migration state into its ``images`` row (role ``target``), one upsert: ``status``,
    ``status_reason`` (``<ExceptionType>: <message>`` for a failure), ``source_ref`` / ``source_digest`` and
    ``digest`` (the verified target digest of a ``completed`` record, else NULL); ``project`` is kept."""
    store.upsert(Image, {"ref": store_ref(record.target_ref)}, _state_values(record, run_id))


def record_pending(store: Store, records: Sequence[MigrationRecord], run_id: str | None = None) -> int:
    """Mark each record's target ``pending`` (inserting missing rows) in ONE transaction; the number of rows.

    An existing row's ``digest`` (the last verified one) and ``project`` are not touched."""
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
    """The migration state the store holds, by target transport reference (``attempts`` is not stored: 0);
    ``target_refs`` None reads every ``target`` row with a status."""
    wanted = None if target_refs is None else {store_ref(ref) for ref in target_refs}
    with store.session() as session:
        statement = select(Image).where(Image.role == "target", Image.status.is_not(None))
        if wanted is not None:
            statement = statement.where(Image.ref.in_(sorted(wanted)))
        rows = [ImageRecord.model_validate(row) for row in session.scalars(statement.order_by(Image.ref))]
    return {f"docker://{row.ref}": _as_record(row) for row in rows}


def completed_in_store(store: Store, pairs: Sequence[tuple[str, str]]) -> dict[str, MigrationRecord]:
    """Targets of ``pairs`` the store records as ``completed`` from the same source, with a digest; the caller
    still checks that the target serves it (the registry is the source of truth)."""
    sources = dict((dst, src) for src, dst in pairs)
    states = load_states(store, list(sources))
    return {
        ref: record for ref, record in states.items()
        if record.status == "completed" and record.target_digest
        and record.source_ref == sources[ref]
    }
