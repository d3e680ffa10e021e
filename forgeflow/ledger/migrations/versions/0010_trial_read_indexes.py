"""The indexes the reads of a large ledger need (a million trials, issue 34).

``ix_trials_job_verdict`` (counts from the index alone) and ``ix_trials_job_created`` (paging); the
single-column ``ix_trials_job_id`` is the prefix of both and goes.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create the two indexes, drop the one they replace."""
    op.create_index("ix_trials_job_verdict", "trials", ["job_id", "voided_at", "exception_type", "reward"])
    op.create_index("ix_trials_job_created", "trials", ["job_id", "created_at", "trial_id"])
    op.drop_index("ix_trials_job_id", table_name="trials")


def downgrade() -> None:
    """Back to 0009's single job index."""
    op.create_index("ix_trials_job_id", "trials", ["job_id"])
    op.drop_index("ix_trials_job_created", table_name="trials")
    op.drop_index("ix_trials_job_verdict", table_name="trials")
