"""Tasks keep their bug patch: ``task_instances.patch`` (existing rows NULL).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add the nullable ``patch`` column."""
    with op.batch_alter_table("task_instances") as batch:
        batch.add_column(sa.Column("patch", sa.Text(), nullable=True))


def downgrade() -> None:
    """Drop the column (the patch texts are lost; their digests stay)."""
    with op.batch_alter_table("task_instances") as batch:
        batch.drop_column("patch")
