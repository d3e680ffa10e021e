"""Batched upserts: many rows of one table in one ``INSERT .. ON CONFLICT DO UPDATE`` run by ``executemany``."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from sqlalchemy import Connection

from forgeflow.ledger.tables import Base, _utcnow

UPSERT_CHUNK_ROWS = 2000
"""Rows per ``executemany``: bounds the parameters held at once."""


@lru_cache(maxsize=256)
def upsert_many_statement(dialect: str, model_cls: type[Base], key_names: tuple[str, ...],
                          value_names: tuple[str, ...]) -> Any:
    """``INSERT .. ON CONFLICT (key_names) DO UPDATE SET value_names`` with no values bound (cached)."""
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    table = model_cls.__table__
    statement = insert(table)
    updated = [*value_names, *(["updated_at"] if "updated_at" in table.columns else [])]
    return statement.on_conflict_do_update(index_elements=sorted(key_names),
                                           set_={name: statement.excluded[name] for name in updated})


def upsert_rows(connection: Connection, model_cls: type[Base],
                rows: Sequence[tuple[dict[str, Any], dict[str, Any]]]) -> None:
    """Upsert validated ``(key, values)`` rows, :data:`UPSERT_CHUNK_ROWS` at a time; one ``updated_at`` per batch.

    Rows with the same key keep the last one's values.
    """
    now = _utcnow()
    stamped = "updated_at" in model_cls.__table__.columns
    groups: dict[tuple[tuple[str, ...], tuple[str, ...]], dict[tuple[Any, ...], dict[str, Any]]] = {}
    for key, values in rows:
        names = (tuple(sorted(key)), tuple(sorted(values)))
        params = {**key, **values, **({"updated_at": now} if stamped else {})}
        groups.setdefault(names, {})[tuple(key[name] for name in names[0])] = params
    for (key_names, value_names), by_key in groups.items():
        statement = upsert_many_statement(connection.dialect.name, model_cls, key_names, value_names)
        params = list(by_key.values())
        for start in range(0, len(params), UPSERT_CHUNK_ROWS):
            connection.execute(statement, params[start:start + UPSERT_CHUNK_ROWS])
