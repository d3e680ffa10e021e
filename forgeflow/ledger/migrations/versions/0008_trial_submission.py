"""Trials keep the submission they were scored on: ``trials.submission``, ``submission_sha256``.

Existing trials keep NULL (a re-score reads their trajectory files).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add the two nullable submission columns."""
    with op.batch_alter_table("trials") as batch:
        batch.add_column(sa.Column("submission", sa.Text(), nullable=True))
        batch.add_column(sa.Column("submission_sha256", sa.String(64), nullable=True))


def downgrade() -> None:
    """Drop the columns (the submissions are lost; their trajectory files, where kept, stay)."""
    with op.batch_alter_table("trials") as batch:
        batch.drop_column("submission_sha256")
        batch.drop_column("submission")
