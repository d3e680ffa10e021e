"""Freezes keep their export bundle's digest: ``freezes.bundle_sha256`` and ``bundle_path``.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add the two nullable bundle columns."""
    with op.batch_alter_table("freezes") as batch:
        batch.add_column(sa.Column("bundle_sha256", sa.String(64), nullable=True))
        batch.add_column(sa.Column("bundle_path", sa.Text(), nullable=True))


def downgrade() -> None:
    """Drop the columns (the bundle digests are lost; the freezes and their files stay)."""
    with op.batch_alter_table("freezes") as batch:
        batch.drop_column("bundle_path")
        batch.drop_column("bundle_sha256")
