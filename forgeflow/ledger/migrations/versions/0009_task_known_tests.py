"""Tasks keep what their pristine runs measured: ``task_instances.known_tests`` and ``pristine_duration_s``.

The verifier checks a submission's run against the task's own (:class:`forgeflow.sandbox.verifier.TaskTests`):
every PASSED/FAILED/ERROR id must be a test the task's pristine NOP/Oracle runs collected (else the
report was forged: tampering), and a timeout is the submission's outcome when the task's pristine run
fits well inside the limit. Validation computed both (the report's ``known_tests``, the Oracle trials'
durations) but the store kept neither, so the canary and RL verifiers never had them. A task now keeps
the sorted ids (JSON list) and the longest Oracle run (seconds). Existing tasks keep NULL: not recorded
(the verifier then skips the known-tests check and re-runs the pristine tests to attribute a timeout).

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
