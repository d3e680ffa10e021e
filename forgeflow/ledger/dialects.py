"""What differs between the store's two dialects: the upsert statement, and an SQLite file's checks and pragmas."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from forgeflow.common.errors import InputError, StoreInvalidError
from forgeflow.ledger.tables import Base, _utcnow


def upsert_statement(
    dialect: str, model_cls: type[Base], key: dict[str, Any], values: dict[str, Any]
) -> Any:
    """The ``INSERT .. ON CONFLICT (key) DO UPDATE SET values`` statement for ``dialect``.

    ``updated_at`` is added (SQLAlchemy does not apply ``onupdate`` inside ON CONFLICT).

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


SQLITE_HEADER = b"SQLite format 3\x00"
"""The first 16 bytes of every SQLite 3 database file (https://www.sqlite.org/fileformat.html)."""


def check_sqlite_header(path: Path) -> None:
    """Refuse a non-empty file at ``path`` that is not an SQLite database (reads 16 bytes).

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


def sqlite_revision(path: Path) -> str | None:
    """The Alembic revision in the SQLite file ``path`` (None: no forgeflow schema), never writing it.

    Raises:
        StoreInvalidError: the file is not an SQLite database.
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


def sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    """WAL journal, a busy timeout, and ``synchronous=NORMAL`` (https://www.sqlite.org/pragma.html#pragma_synchronous).

    A killed process loses no committed transaction; an OS crash may roll back the last ones. Measured, one
    transaction per trial (2 busy cores): 141-190 trials/s with ``FULL``, 1,595-1,767 with ``NORMAL``.
    """
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()
