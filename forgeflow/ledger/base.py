"""The ledger's common ground: one engine, the upsert of validated rows and the read of rows into records.

Each aggregate's record and read methods extend it (:mod:`forgeflow.ledger.trials_ledger`,
:mod:`~forgeflow.ledger.tasks_ledger`, :mod:`~forgeflow.ledger.jobs_ledger`, :mod:`~forgeflow.ledger.models_ledger`);
:class:`forgeflow.ledger.store.Store` joins them."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from operator import itemgetter
from types import SimpleNamespace
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, case, func
from sqlalchemy.orm import Session

from forgeflow.common.errors import InputError
from forgeflow.ledger import batched
from forgeflow.ledger.records import (
    TaskRecord,
    _Record,
)
from forgeflow.ledger.tables import (
    Base,
    Trial,
)

_M = TypeVar("_M", bound=Base)
_R = TypeVar("_R", bound=_Record)


def _verdict_columns() -> list[Any]:
    failed = Trial.exception_type.is_not(None)
    return [func.count().label("trials"),
            func.coalesce(func.sum(case((~failed & (Trial.reward >= 1), 1), else_=0)), 0).label("reward_1"),
            func.coalesce(func.sum(case((~failed & (Trial.reward < 1), 1), else_=0)), 0).label("reward_0"),
            func.coalesce(func.sum(case((failed, 1), else_=0)), 0).label("exceptions")]


class LedgerBase:
    """An ``engine`` and the primitives every aggregate's methods use."""

    engine: Engine

    def _all(self, record_cls: type[_R], statement: Any) -> list[_R]:
        """``statement`` run as Core, each row validated into ``record_cls`` (a third of the ORM's cost at 20,000
        trials).

        Rows are read as attributes, so a stored row's digest is checked where it is used, not here.
        """
        with self.engine.connect() as connection:
            result = connection.execute(statement)
            field_of = {record_cls.COLUMNS.get(f, f): f for f in record_cls.model_fields}  # column -> field
            wanted = [(i, name) for i, name in enumerate(result.keys()) if name in field_of]
            fields = [field_of[name] for _, name in wanted]
            take = itemgetter(*(i for i, _ in wanted))
            return [record_cls.model_validate(SimpleNamespace(**dict(zip(fields, take(row), strict=True))),
                                              from_attributes=True) for row in result]

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session that commits on success and rolls back on error."""
        with Session(self.engine, expire_on_commit=False) as session, session.begin():
            yield session

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
        data = {record.COLUMNS.get(k, k): v for k, v in record.model_dump(mode="json", exclude={"created_at"}).items()}
        if getattr(record, "created_at", None) is not None:
            data["created_at"] = record.created_at  # type: ignore[attr-defined]
        key = {name: data.pop(name) for name in key_fields}
        return key, data

    def _record(self, model_cls: type[Base], key_fields: Sequence[str], record: _Record) -> None:
        self.upsert_many(model_cls, [self._row(key_fields, record)])

    def _task_row(self, record: TaskRecord) -> tuple[dict[str, Any], dict[str, Any]]:
        key, values = self._row(["instance_id"], record)
        if values.get("patch") is None:  # a record without the patch text keeps the one recorded
            values.pop("patch", None)
        return key, values

