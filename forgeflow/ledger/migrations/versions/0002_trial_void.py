"""Void trials: ``trials.voided_at`` (nullable UTC timestamp) and ``trials.void_reason``.

A void trial is kept for audit but excluded from reads and counts (``forgeflow.recovery``).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add the two nullable void columns (existing trials stay valid: not void)."""
    with op.batch_alter_table("trials") as batch:
        batch.add_column(sa.Column("voided_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("void_reason", sa.Text(), nullable=True))


def downgrade() -> None:
    """Drop the void columns (void marks are lost; the trial rows stay)."""
    with op.batch_alter_table("trials") as batch:
        batch.drop_column("void_reason")
        batch.drop_column("voided_at")
