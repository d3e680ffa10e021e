"""Task images, tasks and freezes: what a dataset is made of."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from forgeflow.ledger.base import LedgerBase
from forgeflow.ledger.records import (
    FreezeRecord,
    ImageRecord,
    TaskRecord,
)
from forgeflow.ledger.tables import (
    Freeze,
    Image,
    ImageRole,
    TaskInstance,
    TaskStatus,
)

IDS_PER_QUERY = 500
"""Ids per ``IN`` list of a scoped read (well under SQLite's oldest bound of 999 bound parameters)."""


class TasksLedger(LedgerBase):
    """Record and read task images, tasks (with their validation evidence) and freezes."""

    def record_image(self, record: ImageRecord) -> None:
        """Upsert an image by ``ref``."""
        self._record(Image, ["ref"], record)

    def record_task(self, record: TaskRecord) -> None:
        """Upsert a task by ``instance_id`` (a record without ``patch`` keeps the recorded patch)."""
        self.upsert_many(TaskInstance, [self._task_row(record)])

    def record_freeze(self, record: FreezeRecord) -> None:
        """Upsert a freeze by ``name`` (the manifest file itself is never overwritten)."""
        self._record(Freeze, ["name"], record)

    def get_image(self, ref: str) -> ImageRecord | None:
        """The image row for ``ref``, or None."""
        rows = self._all(ImageRecord, select(Image).where(Image.ref == ref))
        return rows[0] if rows else None

    def image_digests(self, refs: Sequence[str]) -> dict[str, str | None]:
        """The recorded digest of each of ``refs`` that has an image row (None: not known yet)."""
        wanted = sorted(set(refs))
        out: dict[str, str | None] = {}
        with self.engine.connect() as connection:
            for start in range(0, len(wanted), IDS_PER_QUERY):
                statement = select(Image.ref, Image.digest).where(Image.ref.in_(wanted[start:start + IDS_PER_QUERY]))
                out.update({ref: digest for ref, digest in connection.execute(statement)})
        return out

    def images(self, role: ImageRole | None = None) -> list[ImageRecord]:
        """Images ordered by ref, optionally only one ``role``."""
        statement = select(Image).order_by(Image.ref)
        if role is not None:
            statement = statement.where(Image.role == role)
        return self._all(ImageRecord, statement)

    def get_task(self, instance_id: str) -> TaskRecord | None:
        """The task row for ``instance_id``, or None."""
        rows = self._all(
            TaskRecord, select(TaskInstance).where(TaskInstance.instance_id == instance_id)
        )
        return rows[0] if rows else None

    def task_repos(self, instance_ids: Sequence[str]) -> dict[str, str]:
        """The repository of each of ``instance_ids`` that has a task row (ONE read per 500 ids)."""
        ids = list(dict.fromkeys(instance_ids))
        out: dict[str, str] = {}
        with self.engine.connect() as connection:
            for start in range(0, len(ids), 500):
                statement = select(TaskInstance.instance_id, TaskInstance.repo).where(
                    TaskInstance.instance_id.in_(ids[start:start + 500]))
                out.update({instance_id: repo for instance_id, repo in connection.execute(statement)})
        return out

    def tasks_by_id(self, instance_ids: Sequence[str], status: TaskStatus | None = None) -> dict[str, TaskRecord]:
        """The task rows of ``instance_ids`` (only those of ``status`` if given), sorted by instance id.

        ONE primary-key read per :data:`IDS_PER_QUERY` ids; ids without a row are absent.
        """
        ids = sorted(set(instance_ids))
        out: dict[str, TaskRecord] = {}
        for start in range(0, len(ids), IDS_PER_QUERY):
            statement = select(TaskInstance).where(TaskInstance.instance_id.in_(ids[start:start + IDS_PER_QUERY]))
            if status is not None:
                statement = statement.where(TaskInstance.status == status)
            out.update((t.instance_id, t) for t in self._all(TaskRecord, statement))
        return dict(sorted(out.items()))

    def tasks(self, status: TaskStatus | None = None) -> list[TaskRecord]:
        """Tasks ordered by instance id, optionally only one ``status``."""
        statement = select(TaskInstance).order_by(TaskInstance.instance_id)
        if status is not None:
            statement = statement.where(TaskInstance.status == status)
        return self._all(TaskRecord, statement)

    def accepted_tasks(self) -> list[TaskRecord]:
        """Tasks with status ``accepted``, ordered by instance id."""
        return self.tasks("accepted")

    def processed_instance_ids(self) -> set[str]:
        """Instance ids whose validation finished (status other than ``candidate``)."""
        with Session(self.engine) as session:
            ids = session.scalars(
                select(TaskInstance.instance_id).where(TaskInstance.status != "candidate")
            )
            return set(ids)

    def accepted_per_repo(self) -> dict[str, int]:
        """Number of accepted tasks per repo (repos with none are absent)."""
        statement = (
            select(TaskInstance.repo, func.count())
            .where(TaskInstance.status == "accepted")
            .group_by(TaskInstance.repo)
        )
        with Session(self.engine) as session:
            return {repo: count for repo, count in session.execute(statement)}

    def get_freeze(self, name: str) -> FreezeRecord | None:
        """The freeze row called ``name``, or None."""
        rows = self._all(FreezeRecord, select(Freeze).where(Freeze.name == name))
        return rows[0] if rows else None

    def freezes(self) -> list[FreezeRecord]:
        """Every freeze row, newest first (by ``created_at``, then name)."""
        return self._all(FreezeRecord, select(Freeze).order_by(Freeze.created_at.desc(), Freeze.name.desc()))

