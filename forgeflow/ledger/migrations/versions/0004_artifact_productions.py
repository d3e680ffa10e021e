"""Model artifacts can have more than one producer: parent links move to ``model_artifact_productions``.

Keyed by ``production_id`` = sha256 of the JSON ``[sha256, parent_sha256, run_id]`` (formula repeated here:
self-contained). Downgrade keeps only the latest production of each artifact.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _production_id(sha256: str, parent_sha256: str | None, run_id: str | None) -> str:
    """Same as ``forgeflow.store.production_id``: sha256 of canonical JSON (sorted, compact, UTF-8)."""
    text = json.dumps([sha256, parent_sha256, run_id], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _lineage(value: object) -> object:
    """A JSON column read back raw: a string on SQLite, already decoded on PostgreSQL."""
    return json.loads(value) if isinstance(value, str) else (value or {})


def upgrade() -> None:
    """Create the productions table, copy each artifact's parent link into it, drop the columns."""
    productions = op.create_table(
        "model_artifact_productions",
        sa.Column("production_id", sa.String(length=64), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("parent_sha256", sa.String(length=64), nullable=True),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("lineage", sa.JSON(), nullable=False),
        sa.Column("run_id", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("production_id", name=op.f("pk_model_artifact_productions")),
    )
    op.create_index(op.f("ix_model_artifact_productions_sha256"), "model_artifact_productions", ["sha256"])
    op.create_index(op.f("ix_model_artifact_productions_parent_sha256"), "model_artifact_productions",
                    ["parent_sha256"])
    stamp = sa.DateTime(timezone=True)
    old = sa.table("model_artifacts", sa.column("sha256"), sa.column("path"), sa.column("parent_sha256"),
                   sa.column("lineage", sa.JSON()), sa.column("run_id"), sa.column("created_at", stamp),
                   sa.column("updated_at", stamp))
    rows = op.get_bind().execute(sa.select(old)).mappings().all()
    if rows:
        op.bulk_insert(productions, [
            {"production_id": _production_id(r["sha256"], r["parent_sha256"], r["run_id"]), "sha256": r["sha256"],
             "parent_sha256": r["parent_sha256"], "path": r["path"], "lineage": _lineage(r["lineage"]),
             "run_id": r["run_id"], "created_at": r["created_at"], "updated_at": r["updated_at"]}
            for r in rows
        ])
    op.drop_index(op.f("ix_model_artifacts_parent_sha256"), table_name="model_artifacts")
    with op.batch_alter_table("model_artifacts") as batch:
        batch.drop_column("lineage")
        batch.drop_column("parent_sha256")


def downgrade() -> None:
    """Put the latest production's parent, path, lineage and run back on each artifact row."""
    with op.batch_alter_table("model_artifacts") as batch:
        batch.add_column(sa.Column("parent_sha256", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("lineage", sa.JSON(), nullable=True))
    op.create_index(op.f("ix_model_artifacts_parent_sha256"), "model_artifacts", ["parent_sha256"])
    bind = op.get_bind()
    productions = sa.table("model_artifact_productions", sa.column("production_id"), sa.column("sha256"),
                           sa.column("parent_sha256"), sa.column("path"), sa.column("lineage", sa.JSON()),
                           sa.column("run_id"), sa.column("created_at", sa.DateTime(timezone=True)))
    artifacts = sa.table("model_artifacts", sa.column("sha256"), sa.column("parent_sha256"), sa.column("path"),
                         sa.column("lineage", sa.JSON()), sa.column("run_id"))
    latest: dict[str, dict] = {}
    ordered = sa.select(productions).order_by(productions.c.created_at, productions.c.production_id)
    for row in bind.execute(ordered).mappings():
        latest[row["sha256"]] = dict(row)
    for sha, row in latest.items():
        bind.execute(artifacts.update().where(artifacts.c.sha256 == sha).values(
            parent_sha256=row["parent_sha256"], path=row["path"], lineage=_lineage(row["lineage"]),
            run_id=row["run_id"]))
    bind.execute(artifacts.update().where(artifacts.c.lineage.is_(None)).values(lineage={}))
    with op.batch_alter_table("model_artifacts") as batch:
        batch.alter_column("lineage", existing_type=sa.JSON(), nullable=False)
    op.drop_index(op.f("ix_model_artifact_productions_parent_sha256"), table_name="model_artifact_productions")
    op.drop_index(op.f("ix_model_artifact_productions_sha256"), table_name="model_artifact_productions")
    op.drop_table("model_artifact_productions")
