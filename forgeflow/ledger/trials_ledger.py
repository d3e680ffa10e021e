"""Trials and what belongs to them: batches, answer-judge verdicts, supervision events (void trials are left
out of reads unless asked)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from forgeflow.common.errors import InputError
from forgeflow.ledger.base import LedgerBase, _verdict_columns
from forgeflow.ledger.records import (
    TRIAL_VOID_FIELDS,
    BatchRecord,
    JudgmentRecord,
    SupervisionEventRecord,
    TaskRecord,
    TrialRecord,
    check_outcome,
)
from forgeflow.ledger.tables import (
    Batch,
    JudgmentRow,
    SupervisionEvent,
    TaskInstance,
    Trial,
    TrialKind,
    _utcnow,
)


class VerdictCounts(BaseModel):
    """A set of trials counted by verdict (void trials never counted): one job's, or those recorded without a job."""

    model_config = ConfigDict(frozen=True)

    job_id: str | None = Field(None, description="the job counted; None: trials recorded without a job")
    trials: int = Field(ge=0, description="every live trial")
    reward_1: int = Field(ge=0, description="scored 1 (no exception)")
    reward_0: int = Field(ge=0, description="scored below 1 (no exception)")
    exceptions: int = Field(ge=0, description="ended in an exception (flagged ones that kept a reward included)")


class TrialsLedger(LedgerBase):
    """Record and read trials (by job, task or batch), batches, judgments and supervision events."""

    def record_trial(self, record: TrialRecord) -> None:
        """Upsert a trial by ``trial_id``.

        Raises:
            InputError: neither a reward nor an exception, or both (allowed for an agent timeout: Harbor's convention).
        """
        self.record_trials([record])

    def record_trials(self, records: Sequence[TrialRecord],
                      supervision_events: Sequence[SupervisionEventRecord] = ()) -> None:
        """Upsert trials (and their supervision events) in one transaction, as batched ``executemany`` upserts.

        8,000-11,000 trials/s on SQLite (``benchmarks/scale_ledger.py``).

        Raises:
            InputError: as :meth:`record_trial`, naming the first bad trial; nothing is written.
        """
        for record in records:
            check_outcome(record)
        rows = [self._trial_row(record) for record in records]
        with self.engine.begin() as connection:
            self._upsert_rows(connection, Trial, rows)
            if supervision_events:
                self._upsert_rows(connection, SupervisionEvent,
                                  [self._row(["event_id"], event) for event in supervision_events])

    def _trial_row(self, record: TrialRecord) -> tuple[dict[str, Any], dict[str, Any]]:
        """A trial's upsert row: never the void columns; without a submission it keeps the recorded one."""
        key, values = self._row(["trial_id"], record)
        values = {k: v for k, v in values.items() if k not in TRIAL_VOID_FIELDS}
        if values.get("submission") is None:
            values.pop("submission", None)
            values.pop("submission_sha256", None)
        return key, values

    def record_batch(self, record: BatchRecord) -> None:
        """Upsert a batch by ``batch_id``."""
        self._record(Batch, ["batch_id"], record)

    def record_batch_results(
        self, batch: BatchRecord, trials: Sequence[TrialRecord], tasks: Sequence[TaskRecord]
    ) -> None:
        """Upsert a batch's trials, its tasks' statuses and the batch row in ONE transaction.

        Raises:
            InputError: as :meth:`record_trials` (nothing is written).
        """
        for record in trials:
            check_outcome(record)
        with self.engine.begin() as connection:
            self._upsert_rows(connection, Trial, [self._trial_row(record) for record in trials])
            self._upsert_rows(connection, TaskInstance, [self._task_row(record) for record in tasks])
            self._upsert_rows(connection, Batch, [self._row(["batch_id"], batch)])

    def void_trials(
        self,
        trial_ids: Sequence[str],
        reason: str,
        *,
        requeue: Sequence[str] = (),
        voided_at: datetime | None = None,
        run_id: str | None = None,
        check: Any = None,
        requeue_only_from: dict[str, str] | None = None,
    ) -> int:
        """Mark trials void and put tasks back to ``candidate``, in ONE transaction; returns how many were newly voided.

        Void trials stay in the table (audit); trials already void are left as they are.

        Args:
            reason: stored in ``void_reason`` and in each requeued task's ``reason``; non-empty.
            requeue: instance ids whose task goes back to ``candidate`` (test lists cleared).
            voided_at: UTC; default now.
            check: ``callable(session)`` run before the commit; an exception from it rolls everything back.
            requeue_only_from: instance id -> the status the task must still have to be requeued.

        Raises:
            InputError: ``reason`` is empty or a trial id / instance id is unknown (nothing is written).
        """
        from sqlalchemy import update

        if not reason.strip():
            raise InputError("void_trials: reason must not be empty")
        when = voided_at or _utcnow()
        with self.session() as session:
            ids = list(dict.fromkeys(trial_ids))
            found = set(session.scalars(select(Trial.trial_id).where(Trial.trial_id.in_(ids))))
            missing = [trial_id for trial_id in ids if trial_id not in found]
            if missing:
                raise InputError(f"void_trials: unknown trial ids {missing[:10]}")
            tasks = list(dict.fromkeys(requeue))
            known = set(
                session.scalars(
                    select(TaskInstance.instance_id).where(TaskInstance.instance_id.in_(tasks))
                )
            )
            absent = [instance_id for instance_id in tasks if instance_id not in known]
            if absent:
                raise InputError(f"void_trials: unknown instance ids to requeue {absent[:10]}")
            voided = session.execute(
                update(Trial)
                .where(Trial.trial_id.in_(ids), Trial.voided_at.is_(None))
                .values(voided_at=when, void_reason=reason, updated_at=when)
            ).rowcount
            groups: dict[str | None, list[str]] = {}
            for instance_id in tasks:
                groups.setdefault((requeue_only_from or {}).get(instance_id), []).append(instance_id)
            for status, members in groups.items():
                statement = update(TaskInstance).where(TaskInstance.instance_id.in_(members))
                if status is not None:
                    statement = statement.where(TaskInstance.status == status)
                session.execute(statement.values(status="candidate", reason=f"requeued: {reason}", fail_to_pass=[],
                                                 pass_to_pass=[], run_id=run_id, updated_at=when))
            if check is not None:
                session.flush()
                check(session)
            return int(voided or 0)

    def record_judgments(self, records: Sequence[JudgmentRecord]) -> None:
        """Upsert answer-judge verdicts by ``judgment_id``, in one transaction."""
        self.upsert_many(JudgmentRow, [self._row(["judgment_id"], r) for r in records])

    def record_supervision_event(self, record: SupervisionEventRecord) -> None:
        """Upsert a supervision event (dead loop / hang) by ``event_id``."""
        self._record(SupervisionEvent, ["event_id"], record)

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
        return VerdictCounts(job_id=job_id, trials=row.trials, reward_1=row.reward_1, reward_0=row.reward_0,
                             exceptions=row.exceptions)

    def job_repository_counts(self, job_id: str) -> dict[str, int]:
        """Job ``job_id``'s live trials per repository (``-``: no task row)."""
        statement = (select(TaskInstance.repo, func.count())
                     .select_from(Trial).outerjoin(TaskInstance, TaskInstance.instance_id == Trial.instance_id)
                     .where(Trial.job_id == job_id, Trial.voided_at.is_(None))
                     .group_by(TaskInstance.repo))
        with self.engine.connect() as connection:
            return dict(sorted((repo or "-", count) for repo, count in connection.execute(statement)))

    def job_trial_page(self, job_id: str, *, limit: int, offset: int = 0) -> list[TrialRecord]:
        """One page of job ``job_id``'s live trials: at most ``limit`` of them after the first ``offset``, oldest first
        (``created_at``, then ``trial_id``), reading ``limit`` rows whatever the job's size (the job's live trials in
        all: :meth:`job_verdict_counts`' ``trials``).

        Raises:
            ValueError: ``limit`` < 1 or ``offset`` < 0.
        """
        if limit < 1 or offset < 0:
            raise ValueError(f"job_trial_page: limit {limit} must be >= 1 and offset {offset} >= 0")
        live = (Trial.job_id == job_id, Trial.voided_at.is_(None))
        page = select(Trial).where(*live).order_by(Trial.created_at, Trial.trial_id).limit(limit).offset(offset)
        return self._all(TrialRecord, page)

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

    def batches(self, kind: str | None = None) -> list[BatchRecord]:
        """Batches ordered by creation, optionally only one ``kind``."""
        statement = select(Batch).order_by(Batch.created_at, Batch.batch_id)
        if kind is not None:
            statement = statement.where(Batch.kind == kind)
        return self._all(BatchRecord, statement)

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

