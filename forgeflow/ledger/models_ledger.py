"""Model artifacts and their lineage (who produced which bytes from what), and serving generations."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from forgeflow.common.errors import InputError
from forgeflow.ledger.base import LedgerBase
from forgeflow.ledger.dialects import upsert_statement
from forgeflow.ledger.records import (
    ModelArtifactRecord,
    ServingGenerationRecord,
    production_id,
)
from forgeflow.ledger.tables import (
    ArtifactKind,
    ArtifactProduction,
    ModelArtifact,
    ServingGeneration,
    _utcnow,
)


class LineageLedger(LedgerBase):
    """Record and read model artifacts, each production with its parent and run."""

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


class ServingLedger(LedgerBase):
    """Record and read serving generations (blue/green swaps and rollbacks)."""

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

