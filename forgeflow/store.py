"""The ledger of domain facts: SQLAlchemy 2 tables with natural keys, migrated by Alembic.

Every table's primary key is its *natural key* (an image reference, an instance id, a trial id,
a freeze name, a file's sha256, a serving generation), so a resumed run that records the same fact
again *upserts* (``INSERT .. ON CONFLICT (key) DO UPDATE``) and never duplicates a row. Each row
carries the Prefect run id that made it (``run_id``) and ``created_at``/``updated_at`` timestamps
(UTC). No foreign keys: stages record facts in whatever order a resumed run reaches them.

SQLite is the embedded default (``settings.store_url()``); PostgreSQL works by URL
(``FORGEFLOW_STORE_URL=postgresql+psycopg://...``). Both dialects support ON CONFLICT.

The schema is owned by the Alembic migrations in ``forgeflow/migrations``; :meth:`Store.upgrade`
runs them programmatically (no ``alembic.ini``, any working directory). The migration creates
exactly what the models below declare (``tests/core/test_store.py`` checks this with
``alembic.autogenerate.compare_metadata``).

Reads return frozen pydantic records (:class:`ImageRecord`, :class:`TaskRecord`, ...); the same
records are what the ``record_*`` helpers take.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator
from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    Connection,
    DateTime,
    Engine,
    Boolean,
    Float,
    Integer,
    MetaData,
    String,
    Text,
    create_engine,
    event,
    func,
    select,
)
from sqlalchemy.engine import make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from forgeflow import settings
from forgeflow.errors import (
    SCORED_DESPITE_EXCEPTION,
    InputError,
    StoreInvalidError,
    StoreNotFoundError,
    StoreUnavailableError,
)
from forgeflow.fsutil import sha256_json

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
"""Alembic's ``script_location``: ``env.py``, ``script.py.mako`` and ``versions/``."""

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
"""Constraint names are deterministic so migrations can refer to them on every dialect."""

ImageRole = Literal["source", "target", "basecache", "task", "env"]
TaskStatus = Literal["candidate", "accepted", "rejected", "error"]
TrialKind = Literal["nop", "oracle", "agent"]
ArtifactKind = Literal["base", "adapter", "merged", "gguf"]
ServingStatus = Literal["active", "retired", "rolled_back"]
ImageStatus = Literal["pending", "completed", "skipped", "failed"]
SupervisionKind = Literal["dead_loop", "hang"]

_ID = 512
"""Longest natural key (image references and instance ids can be long)."""
_SHA = 64
"""A hex sha256."""


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _check_in(column: str, values: tuple[str, ...]) -> str:
    quoted = ", ".join(f"'{value}'" for value in values)
    return f"{column} IN ({quoted})"


class Base(DeclarativeBase):
    """Declarative base: naming convention plus JSON for dict/list annotations."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        dict[str, Any]: JSON,
        list[str]: JSON,
        datetime: DateTime(timezone=True),
    }


class _Stamped:
    """``run_id`` (the Prefect flow/task run that made the row) and UTC timestamps."""

    run_id: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=_utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=_utcnow)


class Image(_Stamped, Base):
    """A container image by reference (``registry/repo:tag``) and its manifest digest."""

    __tablename__ = "images"
    __table_args__ = (
        CheckConstraint(_check_in("role", ImageRole.__args__), name="role"),
        CheckConstraint(
            f"status IS NULL OR {_check_in('status', ImageStatus.__args__)}", name="status"
        ),
    )

    ref: Mapped[str] = mapped_column(String(_ID), primary_key=True)
    digest: Mapped[str | None] = mapped_column(String(80))
    role: Mapped[str] = mapped_column(String(16))
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    project: Mapped[str | None] = mapped_column(String(256))
    status: Mapped[str | None] = mapped_column(String(16))
    status_reason: Mapped[str | None] = mapped_column(Text)
    source_ref: Mapped[str | None] = mapped_column(String(_ID))
    source_digest: Mapped[str | None] = mapped_column(String(80))


class TaskInstance(_Stamped, Base):
    """A candidate task and its validation outcome (NOP and Oracle runs)."""

    __tablename__ = "task_instances"
    __table_args__ = (CheckConstraint(_check_in("status", TaskStatus.__args__), name="status"),)

    instance_id: Mapped[str] = mapped_column(String(_ID), primary_key=True)
    repo: Mapped[str] = mapped_column(String(256), index=True)
    patch_sha256: Mapped[str | None] = mapped_column(String(_SHA))
    image_ref: Mapped[str | None] = mapped_column(String(_ID))
    status: Mapped[str] = mapped_column(String(16), index=True)
    reason: Mapped[str | None] = mapped_column(Text)
    fail_to_pass: Mapped[list[str]] = mapped_column(default=list)
    pass_to_pass: Mapped[list[str]] = mapped_column(default=list)


class Batch(_Stamped, Base):
    """A batch of instances validated together."""

    __tablename__ = "batches"

    batch_id: Mapped[str] = mapped_column(String(_ID), primary_key=True)
    kind: Mapped[str] = mapped_column(String(32))
    instance_ids: Mapped[list[str]] = mapped_column(default=list)
    concurrency: Mapped[int] = mapped_column(Integer)


class Trial(_Stamped, Base):
    """One trial: an agent (nop, oracle or a model) on one instance, with reward or exception."""

    __tablename__ = "trials"
    __table_args__ = (CheckConstraint(_check_in("kind", TrialKind.__args__), name="kind"),)

    trial_id: Mapped[str] = mapped_column(String(_ID), primary_key=True)
    instance_id: Mapped[str] = mapped_column(String(_ID), index=True)
    batch_id: Mapped[str | None] = mapped_column(String(_ID))
    kind: Mapped[str] = mapped_column(String(16))
    job_id: Mapped[str | None] = mapped_column(String(_ID), index=True)
    reward: Mapped[float | None] = mapped_column(Float)
    exception_type: Mapped[str | None] = mapped_column(String(128))
    exception_message: Mapped[str | None] = mapped_column(Text)
    timings: Mapped[dict[str, Any]] = mapped_column(default=dict)
    model_sha256: Mapped[str | None] = mapped_column(String(_SHA))
    voided_at: Mapped[datetime | None] = mapped_column(nullable=True)
    void_reason: Mapped[str | None] = mapped_column(Text)
    agent_steps: Mapped[int | None] = mapped_column(Integer)
    input_tokens: Mapped[int | None] = mapped_column(Integer)
    output_tokens: Mapped[int | None] = mapped_column(Integer)
    verifier: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class Freeze(_Stamped, Base):
    """A frozen dataset manifest (never overwritten; see :mod:`forgeflow.freeze`)."""

    __tablename__ = "freezes"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    semantic_sha256: Mapped[str] = mapped_column(String(_SHA))
    file_sha256: Mapped[str] = mapped_column(String(_SHA))
    manifest_path: Mapped[str] = mapped_column(Text)
    counts: Mapped[dict[str, Any]] = mapped_column(default=dict)


class ModelArtifact(_Stamped, Base):
    """A model file or folder by content digest: what it is (``kind``, ``quantization``) and the
    last path it was recorded at. Its parents are in :class:`ArtifactProduction`: the same bytes can
    be made by more than one run, from more than one parent."""

    __tablename__ = "model_artifacts"
    __table_args__ = (CheckConstraint(_check_in("kind", ArtifactKind.__args__), name="kind"),)

    sha256: Mapped[str] = mapped_column(String(_SHA), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))
    path: Mapped[str] = mapped_column(Text)
    quantization: Mapped[str | None] = mapped_column(String(32))


class ArtifactProduction(_Stamped, Base):
    """One production of a model artifact: made from ``parent_sha256`` (None for a root such as a
    base model) by run ``run_id``, written at ``path``, with that run's lineage record.

    Append-only in effect: the natural key ``production_id`` is :func:`production_id` of
    ``(sha256, parent_sha256, run_id)``, so a resumed run upserts its own row and another run or
    another parent adds a row; an earlier producer is never overwritten.
    """

    __tablename__ = "model_artifact_productions"

    production_id: Mapped[str] = mapped_column(String(_SHA), primary_key=True)
    sha256: Mapped[str] = mapped_column(String(_SHA), index=True)
    parent_sha256: Mapped[str | None] = mapped_column(String(_SHA), index=True)
    path: Mapped[str] = mapped_column(Text)
    lineage: Mapped[dict[str, Any]] = mapped_column(default=dict)


class ServingGeneration(_Stamped, Base):
    """A blue/green serving generation: which GGUF served on which port (``active``/``retired``), or a
    swap attempt whose new server failed to start or gate (``rolled_back``, see
    :meth:`Store.record_rolled_back_swap`). Keyed by the generation number, unique per store."""

    __tablename__ = "serving_generations"
    __table_args__ = (CheckConstraint(_check_in("status", ServingStatus.__args__), name="status"),)

    generation: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    port: Mapped[int] = mapped_column(Integer)
    gguf_sha256: Mapped[str] = mapped_column(String(_SHA))
    status: Mapped[str] = mapped_column(String(16))


class Job(_Stamped, Base):
    """An evaluation job (a canary run, a recovery re-run, an imported Harbor job).

    A recovery job names the job whose exception trials it re-runs in ``parent_job_id``; the
    original's trials are never rewritten, so a merged view can always say "original job + N
    recovery jobs".
    """

    __tablename__ = "jobs"

    job_id: Mapped[str] = mapped_column(String(_ID), primary_key=True)
    kind: Mapped[str] = mapped_column(String(32))
    parent_job_id: Mapped[str | None] = mapped_column(String(_ID), index=True)
    freeze_name: Mapped[str | None] = mapped_column(String(128))
    split: Mapped[str | None] = mapped_column(String(64))
    model_sha256: Mapped[str | None] = mapped_column(String(_SHA))
    params: Mapped[dict[str, Any]] = mapped_column(default=dict)


class JudgmentRow(_Stamped, Base):
    """An answer-judge verdict (:func:`forgeflow.supervision.judge_answer`) for one question."""

    __tablename__ = "judgments"

    judgment_id: Mapped[str] = mapped_column(String(_ID), primary_key=True)
    job_id: Mapped[str | None] = mapped_column(String(_ID), index=True)
    question_id: Mapped[str] = mapped_column(String(_ID))
    answer: Mapped[str] = mapped_column(Text)
    reference: Mapped[str] = mapped_column(Text)
    correct: Mapped[bool] = mapped_column(Boolean)
    rule: Mapped[str] = mapped_column(String(16))
    normalized_answer: Mapped[str] = mapped_column(Text)
    normalized_reference: Mapped[str] = mapped_column(Text)


class SupervisionEvent(_Stamped, Base):
    """A supervised agent run stopped for a dead loop or a hang, with the evidence."""

    __tablename__ = "supervision_events"
    __table_args__ = (
        CheckConstraint(_check_in("kind", SupervisionKind.__args__), name="kind"),
    )

    event_id: Mapped[str] = mapped_column(String(_ID), primary_key=True)
    trial_id: Mapped[str] = mapped_column(String(_ID), index=True)
    job_id: Mapped[str | None] = mapped_column(String(_ID))
    kind: Mapped[str] = mapped_column(String(16))
    evidence: Mapped[dict[str, Any]] = mapped_column(default=dict)
    trajectory_path: Mapped[str | None] = mapped_column(Text)


# --- records (what the helpers take and return) ------------------------------------------------
_Sha256 = Field(pattern=r"^[0-9a-f]{64}$")


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, from_attributes=True, extra="forbid")

    run_id: str | None = Field(default=None, max_length=64)


class ImageRecord(_Record):
    """A row of ``images``; ``digest`` is ``sha256:<64 hex>`` once known.

    For a migration target, ``status`` is its migration state (pending / completed /
    skipped / failed), ``status_reason`` the skip reason or exception, and ``source_ref`` /
    ``source_digest`` the image it is copied from; None for other images.
    """

    ref: str = Field(min_length=1, max_length=_ID)
    digest: str | None = Field(default=None, pattern=r"^sha256:[0-9a-f]{64}$")
    role: ImageRole
    size_bytes: int | None = Field(default=None, ge=0)
    project: str | None = None
    status: ImageStatus | None = None
    status_reason: str | None = None
    source_ref: str | None = Field(default=None, max_length=_ID)
    source_digest: str | None = Field(default=None, pattern=r"^sha256:[0-9a-f]{64}$")


class TaskRecord(_Record):
    """A row of ``task_instances``; ``reason`` says why a task was rejected or errored."""

    instance_id: str = Field(min_length=1, max_length=_ID)
    repo: str = Field(min_length=1, max_length=256)
    patch_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    image_ref: str | None = None
    status: TaskStatus
    reason: str | None = None
    fail_to_pass: list[str] = Field(default_factory=list)
    pass_to_pass: list[str] = Field(default_factory=list)


class BatchRecord(_Record):
    """A row of ``batches``."""

    batch_id: str = Field(min_length=1, max_length=_ID)
    kind: str = Field(min_length=1, max_length=32)
    instance_ids: list[str]
    concurrency: int = Field(ge=1)


class TrialRecord(_Record):
    """A row of ``trials``: ``reward`` is None when the trial ended in an exception.

    A *void* trial (``voided_at`` set, with ``void_reason``) is kept for audit but excluded from
    reads and counts unless asked (see :mod:`forgeflow.recovery`). ``timings`` maps a phase name to seconds (e.g. ``{"agent_s": 12.5, "verifier_s": 3.1}``).
    ``agent_steps`` / ``input_tokens`` / ``output_tokens``: the agent's model calls and token
    usage (None where not recorded, e.g. nop/oracle trials). ``verifier``: what the verdict rests
    on (:attr:`forgeflow.trial.TrialRecord.verifier`: report format, exit status, output digests,
    a report problem, a submission's screening with ``tampering`` and the protected paths).
    """

    trial_id: str = Field(min_length=1, max_length=_ID)
    instance_id: str = Field(min_length=1, max_length=_ID)
    batch_id: str | None = None
    kind: TrialKind
    job_id: str | None = None
    reward: float | None = None
    exception_type: str | None = Field(default=None, max_length=128)
    exception_message: str | None = None
    timings: dict[str, float] = Field(default_factory=dict)
    model_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    created_at: datetime | None = None
    voided_at: datetime | None = None
    void_reason: str | None = None
    agent_steps: int | None = Field(default=None, ge=0)
    input_tokens: int | None = Field(default=None, ge=0)
    output_tokens: int | None = Field(default=None, ge=0)
    verifier: dict[str, Any] | None = None


TRIAL_VOID_FIELDS = frozenset({"voided_at", "void_reason"})
"""Columns only :meth:`Store.void_trials` writes: re-recording a trial never un-voids it."""


class FreezeRecord(_Record):
    """A row of ``freezes``; ``counts`` maps split name to task count."""

    name: str = Field(min_length=1, max_length=128)
    semantic_sha256: str = _Sha256
    file_sha256: str = _Sha256
    manifest_path: str
    counts: dict[str, int] = Field(default_factory=dict)


class ModelArtifactRecord(_Record):
    """One production of a model artifact: the artifact (``sha256``, ``kind``, ``quantization``)
    made from ``parent_sha256`` by run ``run_id`` at ``path``; ``lineage`` holds e.g. an adapter's
    dataset, hyper-parameters and burst run. ``created_at`` is when that production was first
    recorded (set by the store on reads; None when recording)."""

    sha256: str = _Sha256
    kind: ArtifactKind
    path: str
    quantization: str | None = None
    parent_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    lineage: dict[str, Any] = Field(default_factory=dict)
    created_at: datetime | None = None

    @model_validator(mode="after")
    def _not_its_own_parent(self) -> ModelArtifactRecord:
        if self.parent_sha256 is not None and self.parent_sha256 == self.sha256:
            raise ValueError(
                f"{self.kind} {self.sha256} is recorded as made from itself (parent_sha256 == sha256): "
                "a step that left the bytes unchanged (e.g. an RL burst with zero advantages) made nothing new"
            )
        return self


def production_id(sha256: str, parent_sha256: str | None, run_id: str | None) -> str:
    """The natural key of one production: hex sha256 of the canonical JSON
    ``[sha256, parent_sha256, run_id]`` (migration 0004 computes the same for old rows)."""
    return sha256_json([sha256, parent_sha256, run_id])


class ServingGenerationRecord(_Record):
    """A row of ``serving_generations``."""

    generation: int = Field(ge=0)
    port: int = Field(ge=1, le=65535)
    gguf_sha256: str = _Sha256
    status: ServingStatus


class JobRecord(_Record):
    """A row of ``jobs``; ``kind`` e.g. ``canary``, ``recovery``, ``harbor``.

    ``parent_job_id`` is set on a recovery job (the job whose exception trials it re-runs).
    """

    job_id: str = Field(min_length=1, max_length=_ID)
    kind: str = Field(min_length=1, max_length=32)
    parent_job_id: str | None = Field(default=None, max_length=_ID)
    freeze_name: str | None = Field(default=None, max_length=128)
    split: str | None = Field(default=None, max_length=64)
    model_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    params: dict[str, Any] = Field(default_factory=dict)
    created_at: datetime | None = None


class JudgmentRecord(_Record):
    """A row of ``judgments``: the fields of :class:`forgeflow.supervision.Judgment` plus ids."""

    judgment_id: str = Field(min_length=1, max_length=_ID)
    job_id: str | None = Field(default=None, max_length=_ID)
    question_id: str = Field(min_length=1, max_length=_ID)
    answer: str
    reference: str
    correct: bool
    rule: Literal["number", "list", "string"]
    normalized_answer: str
    normalized_reference: str


class SupervisionEventRecord(_Record):
    """A row of ``supervision_events``; ``evidence`` holds e.g. the loop's signatures and
    indices or the hang's idle seconds."""

    event_id: str = Field(min_length=1, max_length=_ID)
    trial_id: str = Field(min_length=1, max_length=_ID)
    job_id: str | None = Field(default=None, max_length=_ID)
    kind: SupervisionKind
    evidence: dict[str, Any] = Field(default_factory=dict)
    trajectory_path: str | None = None


_M = TypeVar("_M", bound=Base)
_R = TypeVar("_R", bound=_Record)


def _check_outcome(record: TrialRecord) -> None:
    """A trial has a reward or an exception, not both (except an agent timeout, whose verifier
    reward is kept: Harbor's convention) and not neither.

    Raises:
        InputError: naming the trial and both fields.
    """
    both_ok = record.kind == "agent" and record.exception_type in SCORED_DESPITE_EXCEPTION
    if (record.reward is None and record.exception_type is None) or (
        record.reward is not None and record.exception_type is not None and not both_ok
    ):
        raise InputError(
            f"trial {record.trial_id!r} must have exactly one of reward "
            f"({record.reward!r}) and exception_type ({record.exception_type!r})"
        )


class Store:
    """The ledger: one SQLAlchemy engine plus upsert and read helpers.

    Args:
        url: Any SQLAlchemy URL; default :func:`forgeflow.settings.store_url`
            (``$FORGEFLOW_STORE_URL`` or ``sqlite:///$FORGEFLOW_HOME/store.db``). The parent
            folder of a SQLite file is created.
        create: False for commands that only read: a SQLite file that does not exist raises
            :class:`~forgeflow.errors.StoreNotFoundError` instead of being created (and its
            folder is not made). A server database (PostgreSQL) is never created either way.
            The store is then opened and checked before anything else, and never written:
            a file that is not SQLite or has no forgeflow schema (e.g. 0 bytes) is refused,
            and so is a store at an older schema revision — it is *not* migrated here (a read
            must never write); any flow, ``forgeflow up`` or :meth:`upgrade` migrates it.

    Raises:
        InputError: the URL does not parse or names a dialect other than sqlite/postgresql.
        StoreNotFoundError: ``create`` is False and the SQLite file does not exist; the message
            names the path and which setting to fix.
        StoreInvalidError: ``create`` is False and the file or database is not a forgeflow
            store, or its schema revision is not this forgeflow's head (message names the store).
        StoreUnavailableError: ``create`` is False and the database server cannot be reached
            (message names the masked URL and the setting it came from).
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
        if sqlite_file is not None and create:
            sqlite_file.parent.mkdir(parents=True, exist_ok=True)
            _check_sqlite_header(sqlite_file)
        elif sqlite_file is not None:
            if not sqlite_file.is_file():
                raise StoreNotFoundError(f"no forgeflow store at {sqlite_file}; run a flow first or "
                                         + _store_setting_hint(from_settings))
            revision = _sqlite_revision(sqlite_file)  # read before the WAL pragma can write the file
        self.engine: Engine = create_engine(self.url)
        if self.engine.dialect.name == "sqlite":
            event.listen(self.engine, "connect", _sqlite_pragmas)
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
        """Refuse a store whose schema is missing or not at this forgeflow's head (no migration).

        Raises:
            StoreInvalidError: naming ``where`` and what to do.
        """
        from alembic.script import ScriptDirectory

        if revision is None:
            raise StoreInvalidError(f"{where} is not a forgeflow store (it has no forgeflow schema); "
                                    "point FORGEFLOW_HOME or FORGEFLOW_STORE_URL at a store a flow made")
        script = ScriptDirectory.from_config(self.alembic_config())
        head = script.get_current_head()
        if revision == head:
            return
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
        """Run the Alembic migrations up to ``revision`` (idempotent)."""
        from alembic import command

        with self.engine.begin() as connection:
            command.upgrade(self.alembic_config(connection), revision)

    def current_revision(self) -> str | None:
        """The Alembic revision the database is at (None before :meth:`upgrade`)."""
        from alembic.runtime.migration import MigrationContext

        with self.engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()

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
        """Insert a row, or update ``values`` of the row whose natural key is ``key``.

        Uses the dialect's ``INSERT .. ON CONFLICT (key columns) DO UPDATE``, so it is atomic and
        a resumed run never duplicates a row. ``updated_at`` is set on every call;
        ``created_at`` keeps the first insert's value.

        Args:
            model_cls: One of the mapped classes (``Image``, ``Trial``, ...).
            key: Exactly the primary-key columns and their values.
            values: Other columns to set (insert and update).

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
        dialect = self.engine.dialect.name
        with self.engine.begin() as connection:
            for key, values in rows:
                connection.execute(upsert_statement(dialect, model_cls, key, values))

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

    def record_task(self, record: TaskRecord) -> None:
        """Upsert a task by ``instance_id`` (status, reason and test lists are replaced)."""
        self._record(TaskInstance, ["instance_id"], record)

    def record_batch(self, record: BatchRecord) -> None:
        """Upsert a batch by ``batch_id``."""
        self._record(Batch, ["batch_id"], record)

    def record_trial(self, record: TrialRecord) -> None:
        """Upsert a trial by ``trial_id``.

        Raises:
            InputError: the trial has neither a reward nor an exception, or both (allowed only
                for an agent timeout, whose verifier reward is kept: Harbor's convention).
        """
        self.record_trials([record])

    def record_trials(self, records: Sequence[TrialRecord]) -> None:
        """Upsert a batch of trials in one transaction (a crash leaves all or none of them).

        Raises:
            InputError: as :meth:`record_trial`, naming the first bad trial; nothing is written.
        """
        for record in records:
            _check_outcome(record)
        rows = []
        for record in records:
            key, values = self._row(["trial_id"], record)
            rows.append((key, {k: v for k, v in values.items() if k not in TRIAL_VOID_FIELDS}))
        self.upsert_many(Trial, rows)

    def record_batch_results(
        self, batch: BatchRecord, trials: Sequence[TrialRecord], tasks: Sequence[TaskRecord]
    ) -> None:
        """Upsert a batch's trials, its tasks' statuses and the batch row in ONE transaction.

        A crash leaves all or none of them, so a resumed batch never sees trials without the
        statuses they decided (or the reverse).

        Raises:
            InputError: as :meth:`record_trials` (nothing is written).
        """
        for record in trials:
            _check_outcome(record)
        dialect = self.engine.dialect.name
        with self.engine.begin() as connection:
            for record in trials:
                key, values = self._row(["trial_id"], record)
                values = {k: v for k, v in values.items() if k not in TRIAL_VOID_FIELDS}
                connection.execute(upsert_statement(dialect, Trial, key, values))
            for record in tasks:
                connection.execute(upsert_statement(dialect, TaskInstance, *self._row(["instance_id"], record)))
            connection.execute(upsert_statement(dialect, Batch, *self._row(["batch_id"], batch)))

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
        """Mark trials void and put tasks back to ``candidate``, in ONE transaction.

        Void trials stay in the table (audit) with ``voided_at``/``void_reason``; trials that are
        already void are left as they are.

        Args:
            trial_ids: Trials to void.
            reason: Why (non-empty; stored in ``void_reason`` and in each requeued task's
                ``reason``).
            requeue: Instance ids whose task goes back to status ``candidate`` (test lists
                cleared).
            voided_at: The void timestamp (UTC; default now).
            run_id: The run doing it (stamped on the requeued task rows).
            check: Optional ``callable(session)`` run after the writes and before the commit; an
                exception from it rolls everything back (used to verify counts).
            requeue_only_from: Optional instance id -> the status the task must still have to be
                requeued (the status a plan saw); a task whose status changed since is left as it
                is (the ``check`` then sees it).

        Returns:
            The number of trials newly voided.

        Raises:
            InputError: ``reason`` is empty or a trial id / instance id is unknown (nothing is
                written).
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

        The artifact row (by ``sha256``) gets the latest ``path``; the production row (by
        :func:`production_id` of sha256, parent and run) is upserted, so recording the same bytes
        from another parent or by another run *adds* a producer and never replaces an earlier one
        (:meth:`producers` lists them all). A resumed run recording the same production again
        leaves one row.

        Raises:
            InputError: the digest is already recorded with another ``kind`` or ``quantization``
                (the same bytes cannot be both; nothing is written).
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
        """Record a swap that was rolled back as a new ``serving_generations`` row, status ``rolled_back``.

        The row is keyed, like every generation, by its number: one more than the highest number the
        store records (any status), taken and *inserted* (never upserted) in one transaction, so a
        rolled-back attempt can neither reuse nor overwrite another generation's row; the next swap is
        numbered above it. (The state file keeps the generation that still serves: a rollback never
        moves it.)

        Args:
            port: the port the new server was started on.
            gguf_sha256: the GGUF the swap tried to serve (64 hex).
            run_id: the Prefect run that tried the swap.
            attempts: how often to take a new number when a concurrent writer took the same one.

        Returns:
            The recorded row.

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
    def _all(self, record_cls: type[_R], statement: Any) -> list[_R]:
        with Session(self.engine) as session:
            return [record_cls.model_validate(row) for row in session.scalars(statement)]

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
        """Instance ids whose validation finished (status other than ``candidate``).

        A task to validate again (e.g. after an infrastructure fix) is recorded back as
        ``candidate``.
        """
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

    def task_status_counts(self) -> dict[str, int]:
        """Number of tasks per status (statuses with none are absent)."""
        statement = select(TaskInstance.status, func.count()).group_by(TaskInstance.status)
        with Session(self.engine) as session:
            return {status: count for status, count in session.execute(statement)}

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
        """Trials matching every given filter, ordered by ``created_at`` then ``trial_id``.

        Void trials are left out unless ``include_void``.
        """
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
        """Every production of every model artifact, first recorded first, optionally one ``kind``.

        An artifact made by two runs or from two parents appears once per production (same
        ``sha256``, its own ``parent_sha256``, ``run_id``, ``path`` and ``lineage``).
        """
        statement = self._production_select()
        if kind is not None:
            statement = statement.where(ModelArtifact.kind == kind)
        return self._productions(statement)

    def producers(self, sha256: str) -> list[ModelArtifactRecord]:
        """The productions of artifact ``sha256`` (full hex digest), first recorded first; [] when
        unknown."""
        return self._productions(self._production_select().where(ArtifactProduction.sha256 == sha256))

    def serving_generations(self) -> list[ServingGenerationRecord]:
        """Serving generations ordered by generation number."""
        return self._all(
            ServingGenerationRecord,
            select(ServingGeneration).order_by(ServingGeneration.generation),
        )

    def latest_serving_generation(self) -> ServingGenerationRecord | None:
        """The serving generation recorded most recently as ``active`` (latest ``updated_at``, then the
        highest generation); when none is active, the most recently updated one of any status; None
        when no generation is recorded."""
        newest = select(ServingGeneration).order_by(ServingGeneration.updated_at.desc(),
                                                    ServingGeneration.generation.desc()).limit(1)
        for statement in (newest.where(ServingGeneration.status == "active"), newest):
            rows = self._all(ServingGenerationRecord, statement)
            if rows:
                return rows[0]
        return None

    def highest_serving_generation(self) -> int:
        """The highest serving generation number recorded (any status), 0 when none is: a new
        generation, through whichever serving state file, is numbered above it, so generation
        numbers are unique per store."""
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

    def supervision_events(self, trial_id: str | None = None) -> list[SupervisionEventRecord]:
        """Supervision events ordered by creation, optionally of one trial."""
        statement = select(SupervisionEvent).order_by(
            SupervisionEvent.created_at, SupervisionEvent.event_id
        )
        if trial_id is not None:
            statement = statement.where(SupervisionEvent.trial_id == trial_id)
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


def upsert_statement(
    dialect: str, model_cls: type[Base], key: dict[str, Any], values: dict[str, Any]
) -> Any:
    """The ``INSERT .. ON CONFLICT (key) DO UPDATE SET values`` statement for ``dialect``.

    ``updated_at`` is added to the update (SQLAlchemy does not apply ``onupdate`` inside
    ON CONFLICT). Arguments are not validated here; :meth:`Store.upsert` does that.

    Raises:
        InputError: ``dialect`` is neither ``sqlite`` nor ``postgresql``.
    """
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    elif dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    else:
        raise InputError(f"upsert needs sqlite or postgresql, not dialect {dialect!r}")
    table = model_cls.__table__
    row = dict(values)
    if "updated_at" in table.columns:
        row["updated_at"] = _utcnow()
    statement = insert(table).values(**key, **row)
    return statement.on_conflict_do_update(
        index_elements=sorted(key), set_={name: statement.excluded[name] for name in row}
    )


def _store_setting_hint(from_settings: bool) -> str:
    """Which setting named the store, for :class:`StoreNotFoundError` messages."""
    if not from_settings:
        return "give the URL of an existing store"
    if "FORGEFLOW_STORE_URL" in os.environ:
        return "fix FORGEFLOW_STORE_URL"
    return f"set FORGEFLOW_HOME (now {settings.home_path()})"


SQLITE_HEADER = b"SQLite format 3\x00"
"""The first 16 bytes of every SQLite 3 database file (https://www.sqlite.org/fileformat.html)."""


def _check_sqlite_header(path: Path) -> None:
    """Refuse a non-empty file at ``path`` that is not an SQLite database, before a writer opens it
    (reads 16 bytes: no lock, nothing written; a missing or empty file becomes a new store).

    Raises:
        StoreInvalidError: naming the file.
    """
    try:
        with open(path, "rb") as handle:
            head = handle.read(len(SQLITE_HEADER))
    except FileNotFoundError:
        return
    except OSError as exc:
        raise StoreInvalidError(f"{path} cannot be read as a forgeflow store ({exc})") from exc
    if head and head != SQLITE_HEADER:
        raise StoreInvalidError(f"{path} is not a forgeflow store (not an SQLite database)")


def _sqlite_revision(path: Path) -> str | None:
    """The Alembic revision recorded in the SQLite file ``path`` (None: no forgeflow schema),
    read with a plain connection (no pragmas), so the file is never written.

    Raises:
        StoreInvalidError: the file is not an SQLite database (the message names it).
    """
    import sqlite3

    connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "alembic_version" not in tables:
            return None
        row = connection.execute("SELECT version_num FROM alembic_version").fetchone()
        return None if row is None else str(row[0])
    except sqlite3.DatabaseError as exc:
        raise StoreInvalidError(f"{path} is not a forgeflow store ({exc})") from exc
    finally:
        connection.close()


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    """WAL journal and a busy timeout so parallel Prefect tasks can share one SQLite file."""
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()
