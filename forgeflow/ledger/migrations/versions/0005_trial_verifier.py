"""Trials keep the verifier's evidence: ``trials.verifier`` (nullable JSON).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add the nullable ``verifier`` column."""
    with op.batch_alter_table("trials") as batch:
        batch.add_column(sa.Column("verifier", sa.JSON(), nullable=True))


def downgrade() -> None:
    """Drop the column (the evidence is lost; the trial rows stay)."""
    with op.batch_alter_table("trials") as batch:
        batch.drop_column("verifier")
