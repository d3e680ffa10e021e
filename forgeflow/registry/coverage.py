"""What the registries hold against what the store records: coverage, reference rewrite, image lists.

:func:`coverage` (available / missing / errored in a registry, beside the recorded migration state)
and :func:`reconcile_coverage` (a completed row the registry contradicts goes back to pending) read
and write the store's ``images`` rows; :func:`rewrite_refs` moves recorded references between
registry prefixes in one reversible transaction, with a dry-run diff. Also:
:func:`image_names_from_jsonl` (a dataset's image column) and the prewarm plan inputs
:func:`plan_tasks_from_jsonl` / :func:`plan_tasks_from_store`.
"""

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

