"""Tasks keep their bug patch: ``task_instances.patch``.

The freeze's export bundle is what a team hands to its trainers; a row without the patch text
cannot be reproduced or turned into an Oracle sample. The store kept only ``patch_sha256``; it
now keeps the unified diff beside it (its sha256 is checked on record). Existing tasks keep NULL
(their patch is in the candidates file they were loaded from).

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
