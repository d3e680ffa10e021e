"""The ledger of domain facts: SQLAlchemy 2 tables with natural keys, migrated by Alembic.

Every primary key is a natural key, so a resumed run that records a fact again *upserts*
(``INSERT .. ON CONFLICT (key) DO UPDATE``) and never duplicates a row. No foreign keys: stages record
facts in whatever order a resumed run reaches them. SQLite is the embedded default; PostgreSQL works by
URL. The Alembic migrations own the schema (``tests/core/ledger/test_store.py`` compares it to the models).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import (
    Connection,
    Engine,
    create_engine,
    event,
    func,
    select,
)
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from forgeflow.common import settings
from forgeflow.common.errors import (
    InputError,
    StoreInvalidError,
    StoreNotFoundError,
    StoreUnavailableError,
)
from forgeflow.ledger import batched, migrating
from forgeflow.ledger.dialects import check_sqlite_header, sqlite_pragmas, sqlite_revision, upsert_statement
from forgeflow.ledger.migrating import MIGRATIONS_DIR, head_revision
from forgeflow.ledger.queries import StoreReads
from forgeflow.ledger.records import (
    TRIAL_VOID_FIELDS,
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
    check_outcome,
    production_id,
)
from forgeflow.ledger.tables import (
    ArtifactProduction,
    Base,
    Batch,
    Freeze,
    Image,
    Job,
    JudgmentRow,
    ModelArtifact,
    ServingGeneration,
    SupervisionEvent,
    TaskInstance,
    Trial,
    _utcnow,
)

_M = TypeVar("_M", bound=Base)


class Store(StoreReads):
    """The ledger: one SQLAlchemy engine plus upsert and read helpers.

    Args:
        url: any SQLAlchemy URL; default :func:`forgeflow.common.settings.store_url`. A SQLite file's folder is
            created.
        create: False for commands that only read: a missing SQLite file is refused, never created, and the
            store is checked and never written or migrated (a read must never write).

    Raises:
        InputError: the URL does not parse or names a dialect other than sqlite/postgresql.
        StoreNotFoundError: ``create`` is False and the SQLite file does not exist (path and setting named).
        StoreInvalidError: ``create`` is False and it is not a forgeflow store at this forgeflow's head revision.
        StoreUnavailableError: ``create`` is False and the database server cannot be reached.
    """

    SUPPORTED_DIALECTS = ("sqlite", "postgresql")

    def __init__(self, url: str | None = None, *, create: bool = True) -> None:
        from_settings = url is None
        self.url = url if url is not None else settings.store_url()
        try:
            parsed = make_url(self.url)
        except Exception as exc:  # sqlalchemy raises ArgumentError with a terse message
            raise InputError(
                f"store URL {self.url!r} is not a valid SQLAlchemy URL: {exc}"
            ) from exc
        if parsed.get_backend_name() not in self.SUPPORTED_DIALECTS:
            raise InputError(
                f"store URL {parsed.render_as_string(hide_password=True)!r} uses dialect "
                f"{parsed.get_backend_name()!r}; "
                f"supported: {', '.join(self.SUPPORTED_DIALECTS)}"
            )
        sqlite_file = None
        if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
            sqlite_file = Path(parsed.database).expanduser().resolve()
        revision: str | None = None
        self._sqlite_file = sqlite_file
        if sqlite_file is not None and create:
            sqlite_file.parent.mkdir(parents=True, exist_ok=True)
            check_sqlite_header(sqlite_file)
        elif sqlite_file is not None:
            if not sqlite_file.is_file():
                raise StoreNotFoundError(f"no forgeflow store at {sqlite_file}; run a flow first or "
                                         + _store_setting_hint(from_settings))
            revision = sqlite_revision(sqlite_file)  # read before the WAL pragma can write the file
        self.engine: Engine = create_engine(self.url)
        if self.engine.dialect.name == "sqlite":
            event.listen(self.engine, "connect", sqlite_pragmas)
        if not create:
            where = str(sqlite_file) if sqlite_file is not None else self.display_url
            if sqlite_file is None:
                revision = self._server_revision(from_settings)
            self._check_revision(revision, where)

    def _server_revision(self, from_settings: bool) -> str | None:
        """The Alembic revision of a server database, read without writing.

        Raises:
            StoreUnavailableError: the server cannot be reached.
            StoreInvalidError: the database answers but cannot be read as a store.
        """
        from alembic.runtime.migration import MigrationContext
        from sqlalchemy.exc import DatabaseError, OperationalError

        setting = "FORGEFLOW_STORE_URL" if from_settings and "FORGEFLOW_STORE_URL" in os.environ else "store URL"
        try:
            with self.engine.connect() as connection:
                return MigrationContext.configure(connection).get_current_revision()
        except OperationalError as exc:
            first = str(exc.orig if exc.orig is not None else exc).strip().splitlines()[0]
            raise StoreUnavailableError(f"store database {self.display_url} ({setting}) cannot be reached: "
                                        f"{first}") from exc
        except DatabaseError as exc:
            first = str(exc.orig if exc.orig is not None else exc).strip().splitlines()[0]
            raise StoreInvalidError(f"{self.display_url} ({setting}) is not a forgeflow store ({first})") from exc

    def _check_revision(self, revision: str | None, where: str) -> None:
        """Refuse (StoreInvalidError) a store whose schema is missing or not at this forgeflow's head."""
        from alembic.script import ScriptDirectory

        if revision is None:
            raise StoreInvalidError(f"{where} is not a forgeflow store (it has no forgeflow schema); "
                                    "point FORGEFLOW_HOME or FORGEFLOW_STORE_URL at a store a flow made")
        head = head_revision()
        if revision == head:
            return
        script = ScriptDirectory.from_config(self.alembic_config())
        known = {rev.revision for rev in script.walk_revisions()}
        if revision in known:
            raise StoreInvalidError(f"the forgeflow store {where} is at schema revision {revision}, older than "
                                    f"this forgeflow's {head}: run any flow or `forgeflow up` to migrate it")
        raise StoreInvalidError(f"the forgeflow store {where} is at schema revision {revision}, which this "
                                f"forgeflow (head {head}) does not know: a newer forgeflow made it; upgrade forgeflow")

    @property
    def display_url(self) -> str:
        """The store URL with any password masked (``***``): for messages, logs and ``status``."""
        return self.engine.url.render_as_string(hide_password=True)

    # --- schema ----------------------------------------------------------------------------
    def alembic_config(self, connection: Connection | None = None) -> Any:
        """An ``alembic.config.Config`` for this store (no ini file; works from any cwd)."""
        from alembic.config import Config

        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS_DIR))
        # ConfigParser interpolates '%': escape it so URL-encoded passwords survive.
        config.set_main_option("sqlalchemy.url", self.url.replace("%", "%%"))
        if connection is not None:
            config.attributes["connection"] = connection
        return config

    def upgrade(self, revision: str = "head") -> None:
        """Run the Alembic migrations up to ``revision``: idempotent, once per process and store, thread/process safe.

        Raises:
            sqlalchemy.exc.OperationalError: the database cannot be reached.
        """
        migrating.upgrade(self.engine, self.url, self._sqlite_file, self.alembic_config, revision)

    def dispose(self) -> None:
        """Close the engine's pooled connections."""
        self.engine.dispose()

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session that commits on success and rolls back on error."""
        with Session(self.engine, expire_on_commit=False) as session, session.begin():
            yield session

    # --- writes ----------------------------------------------------------------------------
    def upsert(self, model_cls: type[_M], key: dict[str, Any], values: dict[str, Any]) -> None:
        """Insert a row, or update ``values`` of the row whose natural key is ``key`` (atomic: ON CONFLICT).

        ``updated_at`` is set on every call; ``created_at`` keeps the first insert's value.

        Raises:
            InputError: ``key`` is not the table's primary key or a column name is unknown.
        """
        self.upsert_many(model_cls, [(key, values)])

    def upsert_many(self, model_cls: type[_M], rows: Sequence[tuple[dict[str, Any], dict[str, Any]]]) -> None:
        """:meth:`upsert` of many ``(key, values)`` rows in ONE transaction: all or none land.

        Raises:
            InputError: as :meth:`upsert`, for the first bad row (nothing is written then).
        """
        table = model_cls.__table__
        pk = {column.name for column in table.primary_key.columns}
        columns = set(table.columns.keys())
        for key, values in rows:
            if set(key) != pk:
                raise InputError(
                    f"upsert key for {table.name} must be exactly {sorted(pk)}, got {sorted(key)}"
                )
            unknown = set(values) - columns
            if unknown:
                raise InputError(
                    f"upsert values for {table.name} name unknown columns {sorted(unknown)}"
                )
            overlap = set(values) & pk
            if overlap:
                raise InputError(f"upsert values for {table.name} repeat key columns {sorted(overlap)}")
        with self.engine.begin() as connection:
            self._upsert_rows(connection, model_cls, rows)

    def _upsert_rows(self, connection: Connection, model_cls: type[Base],
                     rows: Sequence[tuple[dict[str, Any], dict[str, Any]]]) -> None:
        """Upsert validated ``rows`` on ``connection`` in batches (:func:`forgeflow.ledger.batched.upsert_rows`)."""
        batched.upsert_rows(connection, model_cls, rows)

    def _row(self, key_fields: Sequence[str], record: _Record) -> tuple[dict[str, Any], dict[str, Any]]:
        data = record.model_dump(mode="json", exclude={"created_at"})
        if getattr(record, "created_at", None) is not None:
            data["created_at"] = record.created_at  # type: ignore[attr-defined]
        key = {name: data.pop(name) for name in key_fields}
        return key, data

    def _record(self, model_cls: type[Base], key_fields: Sequence[str], record: _Record) -> None:
        self.upsert_many(model_cls, [self._row(key_fields, record)])

    def record_image(self, record: ImageRecord) -> None:
        """Upsert an image by ``ref``."""
        self._record(Image, ["ref"], record)

    def _task_row(self, record: TaskRecord) -> tuple[dict[str, Any], dict[str, Any]]:
        key, values = self._row(["instance_id"], record)
        if values.get("patch") is None:  # a record without the patch text keeps the one recorded
            values.pop("patch", None)
        return key, values

    def record_task(self, record: TaskRecord) -> None:
        """Upsert a task by ``instance_id`` (a record without ``patch`` keeps the recorded patch)."""
        self.upsert_many(TaskInstance, [self._task_row(record)])

    def record_batch(self, record: BatchRecord) -> None:
        """Upsert a batch by ``batch_id``."""
        self._record(Batch, ["batch_id"], record)

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

    def record_freeze(self, record: FreezeRecord) -> None:
        """Upsert a freeze by ``name`` (the manifest file itself is never overwritten)."""
        self._record(Freeze, ["name"], record)

    def record_model_artifact(self, record: ModelArtifactRecord) -> None:
        """Record one production of a model artifact, in one transaction.

        Recording the same bytes from another parent or run *adds* a producer, never replaces one.

        Raises:
            InputError: the digest is recorded with another ``kind`` or ``quantization`` (nothing is written).
        """
        data = record.model_dump(mode="json", exclude={"created_at"})
        dialect = self.engine.dialect.name
        with self.engine.begin() as connection:
            known = connection.execute(
                select(ModelArtifact.kind, ModelArtifact.quantization).where(ModelArtifact.sha256 == record.sha256)
            ).first()
            if known is not None and (known.kind, known.quantization) != (record.kind, record.quantization):
                raise InputError(
                    f"model artifact {record.sha256} recorded as kind {record.kind!r} quantization "
                    f"{record.quantization!r}, but the store has it as kind {known.kind!r} quantization "
                    f"{known.quantization!r}: the same bytes cannot be both"
                )
            connection.execute(upsert_statement(dialect, ModelArtifact, {"sha256": record.sha256}, {
                "kind": record.kind, "path": record.path, "quantization": record.quantization,
                "run_id": record.run_id}))
            key = {"production_id": production_id(record.sha256, record.parent_sha256, record.run_id)}
            values = {k: data[k] for k in ("sha256", "parent_sha256", "path", "lineage", "run_id")}
            connection.execute(upsert_statement(dialect, ArtifactProduction, key, values))

    def record_serving_generation(self, record: ServingGenerationRecord) -> None:
        """Upsert a serving generation by ``generation``."""
        self._record(ServingGeneration, ["generation"], record)

    def record_rolled_back_swap(self, port: int, gguf_sha256: str, run_id: str | None = None,
                                attempts: int = 5) -> ServingGenerationRecord:
        """Record a rolled-back swap as a new ``serving_generations`` row, status ``rolled_back``.

        Its number is one above the highest recorded, *inserted* (never upserted), so it neither reuses nor
        overwrites another generation; ``attempts`` bounds the retries when a concurrent writer took the number.

        Raises:
            InputError: ``port`` or ``gguf_sha256`` is invalid (nothing is written).
            sqlalchemy.exc.IntegrityError: every attempt collided with a concurrent writer.
        """
        from pydantic import ValidationError
        from sqlalchemy import insert
        from sqlalchemy.exc import IntegrityError

        try:
            ServingGenerationRecord(generation=1, port=port, gguf_sha256=gguf_sha256, status="rolled_back")
        except ValidationError as exc:
            raise InputError(f"rolled-back swap: port {port!r} / gguf_sha256 {gguf_sha256!r} invalid: {exc}") from None
        for attempt in range(attempts):
            try:
                with self.engine.begin() as connection:
                    number = int(connection.scalar(select(func.max(ServingGeneration.generation))) or 0) + 1
                    record = ServingGenerationRecord(generation=number, port=port, gguf_sha256=gguf_sha256,
                                                     status="rolled_back", run_id=run_id)
                    now = _utcnow()
                    connection.execute(insert(ServingGeneration).values(
                        **record.model_dump(mode="json"), created_at=now, updated_at=now))
                return record
            except IntegrityError:
                if attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def record_job(self, record: JobRecord) -> None:
        """Upsert an evaluation job by ``job_id``.

        Raises:
            InputError: the job names itself as its parent.
        """
        if record.parent_job_id == record.job_id:
            raise InputError(f"job {record.job_id!r} cannot be its own parent_job_id")
        self._record(Job, ["job_id"], record)

    def record_judgments(self, records: Sequence[JudgmentRecord]) -> None:
        """Upsert answer-judge verdicts by ``judgment_id``, in one transaction."""
        self.upsert_many(JudgmentRow, [self._row(["judgment_id"], r) for r in records])

    def record_supervision_event(self, record: SupervisionEventRecord) -> None:
        """Upsert a supervision event (dead loop / hang) by ``event_id``."""
        self._record(SupervisionEvent, ["event_id"], record)

    # --- reads -----------------------------------------------------------------------------


def _store_setting_hint(from_settings: bool) -> str:
    """Which setting named the store, for :class:`StoreNotFoundError` messages."""
    if not from_settings:
        return "give the URL of an existing store"
    if "FORGEFLOW_STORE_URL" in os.environ:
        return "fix FORGEFLOW_STORE_URL"
    return f"set FORGEFLOW_HOME (now {settings.home_path()})"


def masked_url(url: str) -> str:
    """``url`` with any password masked (``***``), without connecting."""
    return make_url(url).render_as_string(hide_password=True)
