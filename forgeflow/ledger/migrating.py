"""The store's migrations, run once per process and store, safely from many threads and processes.

Alembic's command API keeps the running migration's context in module globals (``alembic.context``,
``alembic.op``): two threads migrating at once break each other (``KeyError: 'config'``). SQLite runs DDL outside
any transaction, so two processes creating one store's schema at once collide (``table alembic_version already
exists``, the store left with an empty ``alembic_version``). :func:`upgrade` serializes both and answers a store
this process already brought to the head with one read of its ``alembic_version`` row.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable
from contextlib import nullcontext
from functools import cache
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, text

from forgeflow.common.fsutil import file_lock

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
"""Alembic's ``script_location``: ``env.py``, ``script.py.mako`` and ``versions/``."""

MIGRATION_LOCK = threading.RLock()
"""One Alembic command at a time in this process (see the module docstring)."""

_AT_HEAD: set[str] = set()
"""Store URLs this process brought to (or found at) the head revision."""

PG_MIGRATION_LOCK_KEY = zlib.crc32(b"forgeflow.ledger.migrate")
"""The ``pg_advisory_xact_lock`` key that serializes migrations of one PostgreSQL database across processes."""


@cache
def head_revision() -> str:
    """This forgeflow's newest migration id (Alembic's script directory, read once per process)."""
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    head = ScriptDirectory.from_config(config).get_current_head()
    assert head is not None, f"no migration under {MIGRATIONS_DIR}"
    return head


def stored_revision(engine: Engine) -> str | None:
    """The ``alembic_version`` row of ``engine``'s database, read with one plain query (None: no such table or
    row)."""
    from sqlalchemy.exc import DBAPIError

    try:
        with engine.connect() as connection:
            return connection.execute(text("SELECT version_num FROM alembic_version")).scalar()
    except DBAPIError:
        return None


def upgrade(engine: Engine, url: str, sqlite_file: Path | None, alembic_config: Callable[[Any], Any],
            revision: str = "head") -> None:
    """Migrate the store at ``url`` (through ``engine``) to ``revision`` (idempotent).

    A store this process already brought to the head (by URL) and still at it costs one read of
    ``alembic_version``, no Alembic; a store found elsewhere than the head (migrated down, deleted, replaced) is
    migrated again. Migrations are serialized: across threads by :data:`MIGRATION_LOCK`, across processes by a
    file lock beside an SQLite file (``<file>.migrate.lock``) and by ``pg_advisory_xact_lock`` inside
    PostgreSQL's migration transaction; a process that waited then finds the head and changes nothing.

    Args:
        engine: the store's engine.
        url: its URL (the memo's key).
        sqlite_file: the SQLite file, or None (a server database or an in-memory one).
        alembic_config: ``connection -> alembic.config.Config`` migrating through that connection.
        revision: ``head`` or a revision id.

    Raises:
        sqlalchemy.exc.OperationalError: the database cannot be reached.
    """
    if revision == "head" and url in _AT_HEAD and stored_revision(engine) == head_revision():
        return
    from alembic import command

    across = file_lock(f"{sqlite_file}.migrate.lock") if sqlite_file is not None else nullcontext()
    with MIGRATION_LOCK, across:  # threads of this process, then other processes (flock, released on death)
        with engine.begin() as connection:
            if connection.dialect.name == "postgresql":
                connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": PG_MIGRATION_LOCK_KEY})
            command.upgrade(alembic_config(connection), revision)
        if revision in ("head", head_revision()):
            _AT_HEAD.add(url)
        else:
            _AT_HEAD.discard(url)
