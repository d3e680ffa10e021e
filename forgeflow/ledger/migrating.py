"""The store's migrations, run once per process and store, safely from many threads and processes.

Alembic keeps the running migration in module globals (two threads break each other: ``KeyError: 'config'``),
and SQLite runs DDL outside transactions (two processes collide): :func:`upgrade` serializes both.
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
    """The ``alembic_version`` row of ``engine``'s database (None: no such table or row)."""
    from sqlalchemy.exc import DBAPIError

    try:
        with engine.connect() as connection:
            return connection.execute(text("SELECT version_num FROM alembic_version")).scalar()
    except DBAPIError:
        return None


def upgrade(engine: Engine, url: str, sqlite_file: Path | None, alembic_config: Callable[[Any], Any],
            revision: str = "head") -> None:
    """Migrate the store at ``url`` to ``revision`` (idempotent).

    A store this process already brought to the head costs one read. Serialized across threads by
    :data:`MIGRATION_LOCK`, across processes by ``<file>.migrate.lock`` (SQLite) or ``pg_advisory_xact_lock``.

    Args:
        url: the memo's key.
        sqlite_file: None for a server or in-memory database.
        alembic_config: ``connection -> alembic.config.Config`` migrating through that connection.

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
