"""The Store's reads (a base of :class:`forgeflow.ledger.store.Store`); void trials are left out unless asked."""

from __future__ import annotations

from collections.abc import Sequence
from operator import itemgetter
from types import SimpleNamespace
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import (
    Engine,
    case,
    func,
    select,
    text,
)
from sqlalchemy.orm import Session

from forgeflow.ledger.records import (
    BatchRecord,
    FreezeRecord,
    ImageRecord,
    JobRecord,
    JudgmentRecord,
    ModelArtifactRecord,
    ServingGenerationRecord,
    SupervisionEventRecord,
    TaskRecord,
    TrialRecord,
    _Record,
)
from forgeflow.ledger.tables import (
    ArtifactKind,
    ArtifactProduction,
    Base,
    Batch,
    Freeze,
    Image,
    ImageRole,
    Job,
    JudgmentRow,
    ModelArtifact,
    ServingGeneration,
    SupervisionEvent,
    TaskInstance,
    TaskStatus,
    Trial,
    TrialKind,
)

_R = TypeVar("_R", bound=_Record)



IDS_PER_QUERY = 500
"""Ids per ``IN`` list of a scoped read (well under SQLite's oldest bound of 999 bound parameters)."""

JOBS_LISTED_IN_FULL = 20
"""An unknown job id is answered with every job id when there are at most this many, else the closest."""

class VerdictCounts(BaseModel):
    """A set of trials counted by verdict (void trials never counted)."""

    model_config = ConfigDict(frozen=True)

    trials: int = Field(ge=0, description="every live trial")
    reward_1: int = Field(ge=0, description="scored 1 (no exception)")
    reward_0: int = Field(ge=0, description="scored below 1 (no exception)")
    exceptions: int = Field(ge=0, description="ended in an exception (flagged ones that kept a reward included)")


class JobSummary(VerdictCounts):
    """One job's line of the job list: its id (None: trials recorded without a job) and its verdict counts."""

    job_id: str | None


class TrialPage(BaseModel):
    """One page of a job's trials (:meth:`StoreReads.job_trial_page`)."""

    model_config = ConfigDict(frozen=True)

    trials: list[TrialRecord] = Field(description="at most limit trials, oldest first (created_at, then trial_id)")
    total: int = Field(ge=0, description="the job's live trials in all")
    offset: int = Field(ge=0, description="how many were skipped before this page")

    @property
    def remaining(self) -> int:
        """Trials after this page."""
        return max(0, self.total - self.offset - len(self.trials))


_JOB_IDS = text("""
WITH RECURSIVE ids(job_id) AS (
    SELECT (SELECT job_id FROM trials WHERE job_id IS NOT NULL AND voided_at IS NULL ORDER BY job_id LIMIT 1)
    UNION ALL
    SELECT (SELECT t.job_id FROM trials t WHERE t.job_id > ids.job_id AND t.voided_at IS NULL
            ORDER BY t.job_id LIMIT 1)
    FROM ids WHERE ids.job_id IS NOT NULL
)
SELECT job_id FROM ids WHERE job_id IS NOT NULL
""")
"""The distinct job ids of live trials by a loose index scan (one seek of ``ix_trials_job_verdict`` per job,
https://wiki.postgresql.org/wiki/Loose_indexscan): milliseconds however many trials each job holds."""


def _verdict_columns() -> list[Any]:
    failed = Trial.exception_type.is_not(None)
    return [func.count().label("trials"),
            func.coalesce(func.sum(case((~failed & (Trial.reward >= 1), 1), else_=0)), 0).label("reward_1"),
            func.coalesce(func.sum(case((~failed & (Trial.reward < 1), 1), else_=0)), 0).label("reward_0"),
            func.coalesce(func.sum(case((failed, 1), else_=0)), 0).label("exceptions")]


class StoreReads:
    """The read half of :class:`forgeflow.ledger.store.Store` (an ``engine`` attribute is all it uses)."""

    engine: Engine

    def _all(self, record_cls: type[_R], statement: Any) -> list[_R]:
        """``statement`` run as Core, each row validated into ``record_cls`` (a third of the ORM's cost at 20,000
        trials).

        Rows are read as attributes, so a stored row's digest is checked where it is used, not here.
        """
        with self.engine.connect() as connection:
            result = connection.execute(statement)
            wanted = [(i, name) for i, name in enumerate(result.keys()) if name in record_cls.model_fields]
            fields = [name for _, name in wanted]
            take = itemgetter(*(i for i, _ in wanted))
            return [record_cls.model_validate(SimpleNamespace(**dict(zip(fields, take(row), strict=True))),
                                              from_attributes=True) for row in result]

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

    def image_digests(self, refs: Sequence[str]) -> dict[str, str | None]:
        """The recorded digest of each of ``refs`` that has an image row (None: not known yet)."""
        wanted = sorted(set(refs))
        out: dict[str, str | None] = {}
        with self.engine.connect() as connection:
            for start in range(0, len(wanted), IDS_PER_QUERY):
                statement = select(Image.ref, Image.digest).where(Image.ref.in_(wanted[start:start + IDS_PER_QUERY]))
                out.update({ref: digest for ref, digest in connection.execute(statement)})
        return out

    def job_trial_kinds(self, job_id: str) -> list[str]:
        """The sorted kinds of job ``job_id``'s live trials, from an index range alone."""
        statement = (select(Trial.kind).where(Trial.job_id == job_id, Trial.voided_at.is_(None))
                     .group_by(Trial.kind).order_by(Trial.kind))
        with self.engine.connect() as connection:
            return list(connection.scalars(statement))

    def latest_job_trials(self, job_id: str) -> list[TrialRecord]:
        """The latest live trial of each instance job ``job_id`` ran, by instance id.

        Picked in SQL (``row_number()``, SQLite >= 3.25 and PostgreSQL), so only one trial per instance is built.
        """
        newest_first = (Trial.created_at.desc(), Trial.trial_id.desc())
        ranked = (select(Trial.trial_id, func.row_number().over(partition_by=Trial.instance_id,
                                                                order_by=newest_first).label("rank"))
                  .where(Trial.job_id == job_id, Trial.voided_at.is_(None)).subquery())
        statement = (select(Trial).join(ranked, ranked.c.trial_id == Trial.trial_id).where(ranked.c.rank == 1)
                     .order_by(Trial.instance_id))
        return self._all(TrialRecord, statement)

    def get_image(self, ref: str) -> ImageRecord | None:
        """The image row for ``ref``, or None."""
        rows = self._all(ImageRecord, select(Image).where(Image.ref == ref))
        return rows[0] if rows else None

    def get_task(self, instance_id: str) -> TaskRecord | None:
        """The task row for ``instance_id``, or None."""
        rows = self._all(
            TaskRecord, select(TaskInstance).where(TaskInstance.instance_id == instance_id)
        )
        return rows[0] if rows else None

    def get_freeze(self, name: str) -> FreezeRecord | None:
        """The freeze row called ``name``, or None."""
        rows = self._all(FreezeRecord, select(Freeze).where(Freeze.name == name))
        return rows[0] if rows else None

    def freezes(self) -> list[FreezeRecord]:
        """Every freeze row, newest first (by ``created_at``, then name)."""
        return self._all(FreezeRecord, select(Freeze).order_by(Freeze.created_at.desc(), Freeze.name.desc()))

    def images(self, role: ImageRole | None = None) -> list[ImageRecord]:
        """Images ordered by ref, optionally only one ``role``."""
        statement = select(Image).order_by(Image.ref)
        if role is not None:
            statement = statement.where(Image.role == role)
        return self._all(ImageRecord, statement)

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

    def trials_for(
        self,
        *,
        kind: TrialKind | None = None,
        job_id: str | None = None,
        instance_id: str | None = None,
        batch_id: str | None = None,
        trial_ids: Sequence[str] | None = None,
        include_void: bool = False,
    ) -> list[TrialRecord]:
        """Trials matching every given filter, ordered by ``created_at`` then ``trial_id``."""
        statement = select(Trial).order_by(Trial.created_at, Trial.trial_id)
        if not include_void:
            statement = statement.where(Trial.voided_at.is_(None))
        if batch_id is not None:
            statement = statement.where(Trial.batch_id == batch_id)
        if trial_ids is not None:
            statement = statement.where(Trial.trial_id.in_(list(trial_ids)))
        if kind is not None:
            statement = statement.where(Trial.kind == kind)
        if job_id is not None:
            statement = statement.where(Trial.job_id == job_id)
        if instance_id is not None:
            statement = statement.where(Trial.instance_id == instance_id)
        return self._all(TrialRecord, statement)

    def job_summaries(self) -> list[JobSummary]:
        """Every job with live trials, counted by verdict in ONE aggregate read (~1 s at a million trials).

        Ordered by job id, trials without a job last.
        """
        statement = (select(Trial.job_id, *_verdict_columns()).where(Trial.voided_at.is_(None))
                     .group_by(Trial.job_id))
        with Session(self.engine) as session:
            rows = [JobSummary(job_id=row.job_id, trials=row.trials, reward_1=row.reward_1, reward_0=row.reward_0,
                               exceptions=row.exceptions) for row in session.execute(statement)]
        return sorted(rows, key=lambda row: (row.job_id is None, row.job_id or ""))

    def job_ids(self) -> list[str]:
        """The ids of the jobs that have live trials, sorted (a loose index scan: one seek per job)."""
        with self.engine.connect() as connection:
            return [row[0] for row in connection.execute(_JOB_IDS)]

    def unknown_job_message(self, job_id: str) -> str:
        """The message for a job id with no live trials: every job id there is, else the closest."""
        import difflib  # noqa: PLC0415

        ids = self.job_ids()
        where = f"job {job_id!r} has no trials in {self.display_url}; "
        if len(ids) <= JOBS_LISTED_IN_FULL:
            return where + f"jobs with trials: {', '.join(ids) or 'none'}"
        close = difflib.get_close_matches(job_id, ids, n=5, cutoff=0.5)
        return where + (f"closest: {', '.join(close)}" if close else "no job id is close") + (
            f" ({len(ids)} jobs with trials: `forgeflow trials` lists them)")

    def has_trials(self, job_id: str) -> bool:
        """Whether job ``job_id`` has a live trial (one index seek)."""
        statement = select(Trial.trial_id).where(Trial.job_id == job_id, Trial.voided_at.is_(None)).limit(1)
        with self.engine.connect() as connection:
            return connection.execute(statement).first() is not None

    def job_verdict_counts(self, job_id: str) -> VerdictCounts:
        """Job ``job_id``'s live trials counted by verdict (an index range of ``ix_trials_job_verdict``)."""
        statement = select(*_verdict_columns()).where(Trial.job_id == job_id, Trial.voided_at.is_(None))
        with self.engine.connect() as connection:
            row = connection.execute(statement).one()
        return VerdictCounts(trials=row.trials, reward_1=row.reward_1, reward_0=row.reward_0,
                             exceptions=row.exceptions)

    def job_repository_counts(self, job_id: str) -> dict[str, int]:
        """Job ``job_id``'s live trials per repository (``-``: no task row)."""
        statement = (select(TaskInstance.repo, func.count())
                     .select_from(Trial).outerjoin(TaskInstance, TaskInstance.instance_id == Trial.instance_id)
                     .where(Trial.job_id == job_id, Trial.voided_at.is_(None))
                     .group_by(TaskInstance.repo))
        with self.engine.connect() as connection:
            return dict(sorted((repo or "-", count) for repo, count in connection.execute(statement)))

    def job_trial_page(self, job_id: str, *, limit: int, offset: int = 0) -> TrialPage:
        """One page of job ``job_id``'s live trials, oldest first, reading ``limit`` rows whatever the job's size.

        Raises:
            ValueError: ``limit`` < 1 or ``offset`` < 0.
        """
        if limit < 1 or offset < 0:
            raise ValueError(f"job_trial_page: limit {limit} must be >= 1 and offset {offset} >= 0")
        live = (Trial.job_id == job_id, Trial.voided_at.is_(None))
        page = select(Trial).where(*live).order_by(Trial.created_at, Trial.trial_id).limit(limit).offset(offset)
        with self.engine.connect() as connection:
            total = connection.scalar(select(func.count()).select_from(Trial).where(*live)) or 0
        return TrialPage(trials=self._all(TrialRecord, page), total=total, offset=offset)

    def validation_seconds(self, instance_ids: Sequence[str]) -> dict[str, float]:
        """Seconds each task's last validation took: per kind the newest live trial's ``env_setup_s + verifier_s``,
        summed.
        """
        statement = (select(Trial.instance_id, Trial.kind, Trial.timings)
                     .where(Trial.voided_at.is_(None), Trial.kind.in_(["nop", "oracle"]),
                            Trial.instance_id.in_(list(instance_ids)))
                     .order_by(Trial.created_at, Trial.trial_id))
        newest: dict[tuple[str, str], float] = {}
        with Session(self.engine) as session:
            for instance_id, kind, timings in session.execute(statement):
                timings = timings or {}
                newest[(instance_id, kind)] = float(timings.get("env_setup_s", 0.0)) + float(
                    timings.get("verifier_s", 0.0))
        seconds: dict[str, float] = {}
        for (instance_id, _), value in newest.items():
            seconds[instance_id] = seconds.get(instance_id, 0.0) + value
        return seconds

    def _productions(self, statement: Any) -> list[ModelArtifactRecord]:
        with Session(self.engine) as session:
            return [
                ModelArtifactRecord(sha256=p.sha256, kind=a.kind, quantization=a.quantization, path=p.path,
                                    parent_sha256=p.parent_sha256, lineage=p.lineage, run_id=p.run_id,
                                    created_at=p.created_at)
                for a, p in session.execute(statement)
            ]

    def _production_select(self) -> Any:
        return (
            select(ModelArtifact, ArtifactProduction)
            .join(ArtifactProduction, ArtifactProduction.sha256 == ModelArtifact.sha256)
            .order_by(ArtifactProduction.created_at, ArtifactProduction.production_id)
        )

    def model_artifacts(self, kind: ArtifactKind | None = None) -> list[ModelArtifactRecord]:
        """Every production of every model artifact (once per production), first recorded first."""
        statement = self._production_select()
        if kind is not None:
            statement = statement.where(ModelArtifact.kind == kind)
        return self._productions(statement)

    def producers(self, sha256: str) -> list[ModelArtifactRecord]:
        """The productions of artifact ``sha256``, first recorded first; [] when unknown."""
        return self._productions(self._production_select().where(ArtifactProduction.sha256 == sha256))

    def serving_generations(self) -> list[ServingGenerationRecord]:
        """Serving generations ordered by generation number."""
        return self._all(
            ServingGenerationRecord,
            select(ServingGeneration).order_by(ServingGeneration.generation),
        )

    def latest_serving_generation(self) -> ServingGenerationRecord | None:
        """The newest ``active`` serving generation, else the newest of any status; None if none."""
        newest = select(ServingGeneration).order_by(ServingGeneration.updated_at.desc(),
                                                    ServingGeneration.generation.desc()).limit(1)
        for statement in (newest.where(ServingGeneration.status == "active"), newest):
            rows = self._all(ServingGenerationRecord, statement)
            if rows:
                return rows[0]
        return None

    def highest_serving_generation(self) -> int:
        """The highest serving generation number recorded (any status), 0 when none is."""
        with Session(self.engine) as session:
            return int(session.scalar(select(func.max(ServingGeneration.generation))) or 0)

    def batches(self, kind: str | None = None) -> list[BatchRecord]:
        """Batches ordered by creation, optionally only one ``kind``."""
        statement = select(Batch).order_by(Batch.created_at, Batch.batch_id)
        if kind is not None:
            statement = statement.where(Batch.kind == kind)
        return self._all(BatchRecord, statement)

    def get_job(self, job_id: str) -> JobRecord | None:
        """The job row for ``job_id``, or None."""
        rows = self._all(JobRecord, select(Job).where(Job.job_id == job_id))
        return rows[0] if rows else None

    def jobs(self, *, kind: str | None = None, parent_job_id: str | None = None) -> list[JobRecord]:
        """Jobs ordered by creation, filtered by ``kind`` and/or ``parent_job_id``."""
        statement = select(Job).order_by(Job.created_at, Job.job_id)
        if kind is not None:
            statement = statement.where(Job.kind == kind)
        if parent_job_id is not None:
            statement = statement.where(Job.parent_job_id == parent_job_id)
        return self._all(JobRecord, statement)

    def judgments(self, job_id: str | None = None) -> list[JudgmentRecord]:
        """Answer-judge verdicts ordered by creation, optionally of one job."""
        statement = select(JudgmentRow).order_by(JudgmentRow.created_at, JudgmentRow.judgment_id)
        if job_id is not None:
            statement = statement.where(JudgmentRow.job_id == job_id)
        return self._all(JudgmentRecord, statement)

    def supervision_events(self, trial_id: str | None = None,
                           trial_ids: Sequence[str] | None = None) -> list[SupervisionEventRecord]:
        """Supervision events ordered by creation, optionally of one trial or of the trials ``trial_ids``."""
        statement = select(SupervisionEvent).order_by(
            SupervisionEvent.created_at, SupervisionEvent.event_id
        )
        if trial_id is not None:
            statement = statement.where(SupervisionEvent.trial_id == trial_id)
        if trial_ids is not None:
            statement = statement.where(SupervisionEvent.trial_id.in_(list(trial_ids)))
        return self._all(SupervisionEventRecord, statement)

    def counts(self, include_void: bool = False) -> dict[str, int]:
        """Row count per table name (every table, zero included); void trials only if asked."""
        with Session(self.engine) as session:
            out = {}
            for table in Base.metadata.sorted_tables:
                statement = select(func.count()).select_from(table)
                if table.name == Trial.__tablename__ and not include_void:
                    statement = statement.where(table.c.voided_at.is_(None))
                out[table.name] = session.scalar(statement) or 0
            return out
