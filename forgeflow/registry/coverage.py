"""What the registries hold against what the store records: coverage, reference rewrite, image lists."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select, update

from forgeflow.common.errors import (
    ForgeflowError,
    ImageNotFoundError,
    InputError,
)
from forgeflow.common.fsutil import read_jsonl_objects
from forgeflow.ledger.records import ImageRecord
from forgeflow.ledger.store import Store
from forgeflow.ledger.tables import Image, ImageRole, TaskInstance
from forgeflow.registry.migration import store_ref
from forgeflow.registry.skopeo import Skopeo

ImageAvailability = Literal["available", "missing", "errored"]

REWRITE_IMAGE_ROLES: tuple[str, ...] = ("task", "env", "basecache")
"""Image roles whose references :func:`rewrite_refs` moves by default. ``source`` and ``target``
rows are the migration's own record of both sides and stay where they are."""


def image_names_from_jsonl(path: str | Path, column: str = "image") -> list[str]:
    """The distinct non-empty image names (``repo:tag``) of a dataset's JSONL file, in first-occurrence order.

    Raises:
        InputError: a missing file, a line not a JSON object, or a row without ``column`` (line named).
    """
    names: dict[str, None] = {}
    for number, row in read_jsonl_objects(path, "dataset file"):
        if not isinstance(row.get(column), str) or not row[column]:
            raise InputError(f"{path}:{number} has no non-empty string column {column!r}")
        names.setdefault(row[column], None)
    return list(names)


class AvailabilityRow(BaseModel):
    """Whether one image is in the target registry, beside what the store records for it."""

    model_config = ConfigDict(frozen=True)

    ref: str = Field(description="Transport reference checked.")
    availability: ImageAvailability = Field(
        description="available (the registry serves a manifest), missing (it answers \"not found\") or errored (it "
                    "could not say: unavailable, auth, ...).")
    digest: str | None = Field(None, description="The served digest when available.")
    error_type: str | None = Field(None, description="Exception class name when errored.")
    error: str = Field("", description="Exception message when errored.")
    recorded_status: str | None = Field(None,
                                        description="The migration status of the image's images row (None: no row, "
                                                    "or no store given).")
    recorded_digest: str | None = Field(None, description="The digest that row records (None if none).")
    drift: str = Field("",
                       description="Why the registry contradicts a completed row (missing, or another digest); "
                                   "empty when they agree or nothing is recorded.")


class CoverageReport(BaseModel):
    """How much of an image list a registry serves.

    Attributes:
        available / missing / errored: Counts per :data:`ImageAvailability`.
    """

    model_config = ConfigDict(frozen=True)

    total: int = Field(ge=0, description="Images checked.")
    available: int = Field(ge=0)
    missing: int = Field(ge=0)
    errored: int = Field(ge=0)
    drifted: int = Field(default=0, ge=0, description="Rows whose completed store state the registry contradicts.")
    rows: list[AvailabilityRow] = Field(description="One row per image, input order.")


def coverage(
    skopeo: Skopeo, refs: Sequence[str], max_workers: int = 4, store: Store | None = None
) -> CoverageReport:
    """Check which of ``refs`` the registry serves (``skopeo inspect --raw``, ``max_workers`` 1-16 at a time).

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
    """One reference a rewrite changes."""

    model_config = ConfigDict(frozen=True)

    table: Literal["images", "task_instances"] = Field(description="images or task_instances.")
    key: str = Field(description="The row's natural key (images.ref before the change, or the instance id).")
    column: Literal["ref", "image_ref"] = Field(description="ref or image_ref.")
    old: str = Field(description="The reference before.")
    new: str = Field(description="The reference after.")


class RewritePlan(BaseModel):
    """The diff of a reference rewrite and whether it was applied.

    Attributes:
        old_prefix / new_prefix: As given.
    """

    model_config = ConfigDict(frozen=True)

    old_prefix: str
    new_prefix: str
    image_roles: tuple[str, ...] = Field(description="Image roles whose images.ref rows were in scope.")
    rows: list[RewriteRow] = Field(description="Every change, sorted by table then key.")
    applied: bool = Field(description="False for a dry run.")
    unmatched_example: str | None = Field(
        None,
        description="When nothing lies under old_prefix (rows empty): one recorded in-scope reference, to show what "
                    "the references look like (None when there are rows or nothing is recorded).")


_PREFIX = re.compile(r"[A-Za-z0-9.-]+(?::\d{1,5})?(?:/[A-Za-z0-9._-]+)*")


def _under(ref: str, prefix: str) -> bool:
    """``ref`` lies under ``prefix`` at a name boundary: ``prefix/...`` always; ``prefix:tag`` and
    ``prefix@digest`` when the prefix ends in a repository (it has a ``/``: after a bare host a
    ``:`` starts the port, so ``127.0.0.1`` never matches ``127.0.0.1:5702/...``)."""
    if ref.startswith(prefix + "/"):
        return True
    return "/" in prefix and ref.startswith((prefix + ":", prefix + "@"))


def registry_prefix(value: str) -> str:
    """``value`` without a trailing ``/``, if it is ``host[:port][/path]``.

    Raises:
        InputError: it is not (a URL scheme, spaces, an empty path component).
    """
    prefix = value.rstrip("/")
    if not _PREFIX.fullmatch(prefix):
        raise InputError(f"{value!r} is not host[:port][/path]")
    return prefix


def check_apart(old_prefix: str, new_prefix: str) -> None:
    """Refuse a rewrite whose prefixes are equal or nest (it would not be reversible).

    Raises:
        InputError: naming both prefixes.
    """
    if old_prefix == new_prefix or _under(old_prefix, new_prefix) or _under(new_prefix, old_prefix):
        raise InputError(f"old_prefix {old_prefix!r} and new_prefix {new_prefix!r} must not contain each other")


def rewrite_refs(
    store: Store,
    old_prefix: str,
    new_prefix: str,
    dry_run: bool = True,
    *,
    image_roles: Sequence[str] = REWRITE_IMAGE_ROLES,
) -> RewritePlan:
    """Move recorded image references from one registry prefix to another, in ONE transaction (a dry run
    returns the plan with ``applied`` False).

    Raises:
        InputError: a prefix not ``host[:port][/path]``, equal or nested prefixes, an unknown role, or
            references already under ``new_prefix`` (up to 10 named); nothing is written then.
    """
    old_prefix, new_prefix = registry_prefix(old_prefix), registry_prefix(new_prefix)
    check_apart(old_prefix, new_prefix)
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
        InputError: a missing file, a line not a JSON object, or a column missing or empty (line named).
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

