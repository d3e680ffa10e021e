"""The ledger of domain facts: SQLAlchemy 2 tables with natural keys, migrated by Alembic.

Every primary key is a natural key, so a resumed run that records a fact again *upserts*
(``INSERT .. ON CONFLICT (key) DO UPDATE``) and never duplicates a row. No foreign keys: stages record
facts in whatever order a resumed run reaches them. SQLite is the embedded default; PostgreSQL works by
URL. The Alembic migrations own the schema (``tests/core/ledger/test_store.py`` compares it to the models).

The record and read methods live with their aggregate (trials, tasks, jobs, lineage, serving); ``Store`` joins them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, func, select
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from forgeflow.common import settings
from forgeflow.common.errors import InputError, StoreInvalidError, StoreNotFoundError, StoreUnavailableError
from forgeflow.ledger import migrating
from forgeflow.ledger.dialects import check_sqlite_header, sqlite_pragmas, sqlite_revision
from forgeflow.ledger.jobs_ledger import JobsLedger
from forgeflow.ledger.migrating import MIGRATIONS_DIR, head_revision
from forgeflow.ledger.models_ledger import LineageLedger, ServingLedger
from forgeflow.ledger.tables import (
    Base,
    Trial,
)
from forgeflow.ledger.tasks_ledger import TasksLedger
from forgeflow.ledger.trials_ledger import TrialsLedger


class Store(TrialsLedger, TasksLedger, JobsLedger, LineageLedger, ServingLedger):
    """The ledger: one SQLAlchemy engine, each aggregate's record and read methods, the schema's migrations.

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
