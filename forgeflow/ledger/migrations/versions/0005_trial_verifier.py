"""Trials keep the verifier's evidence: ``trials.verifier`` (nullable JSON).

What a reward or a NOP/Oracle verdict rests on: the run's report format, exit status, output
digests and any problem with its report, and for a submission its screening (tamper policy,
protected paths touched, tampering). Existing trials keep NULL (recorded before the evidence was).

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
