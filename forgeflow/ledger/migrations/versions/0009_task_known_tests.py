"""Tasks keep what their pristine runs measured: ``known_tests`` and ``pristine_duration_s``.

Existing tasks keep NULL: not recorded (the verifier skips the known-tests check).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add the two nullable columns."""
    with op.batch_alter_table("task_instances") as batch:
        batch.add_column(sa.Column("known_tests", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("pristine_duration_s", sa.Float(), nullable=True))


def downgrade() -> None:
    """Drop the columns (a later validation records them again)."""
    with op.batch_alter_table("task_instances") as batch:
        batch.drop_column("pristine_duration_s")
        batch.drop_column("known_tests")
