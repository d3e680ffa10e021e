"""Image migration state, trial costs, and the tables jobs, judgments, supervision_events.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _stamps() -> list[sa.Column]:
    return [
        sa.Column("run_id", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    ]


def upgrade() -> None:
    """Add the nullable columns (existing rows stay valid) and create the three tables."""
    with op.batch_alter_table("images") as batch:
        batch.add_column(sa.Column("status", sa.String(length=16), nullable=True))
        batch.add_column(sa.Column("status_reason", sa.Text(), nullable=True))
        batch.add_column(sa.Column("source_ref", sa.String(length=512), nullable=True))
        batch.add_column(sa.Column("source_digest", sa.String(length=80), nullable=True))
        batch.create_check_constraint(
            op.f("ck_images_status"),
            "status IS NULL OR status IN ('pending', 'completed', 'skipped', 'failed')",
        )
    with op.batch_alter_table("trials") as batch:
        batch.add_column(sa.Column("agent_steps", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("input_tokens", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("output_tokens", sa.Integer(), nullable=True))
    op.create_table(
        "jobs",
        sa.Column("job_id", sa.String(length=512), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("parent_job_id", sa.String(length=512), nullable=True),
        sa.Column("freeze_name", sa.String(length=128), nullable=True),
        sa.Column("split", sa.String(length=64), nullable=True),
        sa.Column("model_sha256", sa.String(length=64), nullable=True),
        sa.Column("params", sa.JSON(), nullable=False),
        *_stamps(),
        sa.PrimaryKeyConstraint("job_id", name=op.f("pk_jobs")),
    )
    op.create_index(op.f("ix_jobs_parent_job_id"), "jobs", ["parent_job_id"])
    op.create_table(
        "judgments",
        sa.Column("judgment_id", sa.String(length=512), nullable=False),
        sa.Column("job_id", sa.String(length=512), nullable=True),
        sa.Column("question_id", sa.String(length=512), nullable=False),
        sa.Column("answer", sa.Text(), nullable=False),
        sa.Column("reference", sa.Text(), nullable=False),
        sa.Column("correct", sa.Boolean(), nullable=False),
        sa.Column("rule", sa.String(length=16), nullable=False),
        sa.Column("normalized_answer", sa.Text(), nullable=False),
        sa.Column("normalized_reference", sa.Text(), nullable=False),
        *_stamps(),
        sa.PrimaryKeyConstraint("judgment_id", name=op.f("pk_judgments")),
    )
    op.create_index(op.f("ix_judgments_job_id"), "judgments", ["job_id"])
    op.create_table(
        "supervision_events",
        sa.Column("event_id", sa.String(length=512), nullable=False),
        sa.Column("trial_id", sa.String(length=512), nullable=False),
        sa.Column("job_id", sa.String(length=512), nullable=True),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("evidence", sa.JSON(), nullable=False),
        sa.Column("trajectory_path", sa.Text(), nullable=True),
        *_stamps(),
        sa.CheckConstraint(
            "kind IN ('dead_loop', 'hang')", name=op.f("ck_supervision_events_kind")
        ),
        sa.PrimaryKeyConstraint("event_id", name=op.f("pk_supervision_events")),
    )
    op.create_index(op.f("ix_supervision_events_trial_id"), "supervision_events", ["trial_id"])


def downgrade() -> None:
    """Drop the three tables and the added columns."""
    op.drop_index(op.f("ix_supervision_events_trial_id"), table_name="supervision_events")
    op.drop_table("supervision_events")
    op.drop_index(op.f("ix_judgments_job_id"), table_name="judgments")
    op.drop_table("judgments")
    op.drop_index(op.f("ix_jobs_parent_job_id"), table_name="jobs")
    op.drop_table("jobs")
    with op.batch_alter_table("trials") as batch:
        batch.drop_column("output_tokens")
        batch.drop_column("input_tokens")
        batch.drop_column("agent_steps")
    with op.batch_alter_table("images") as batch:
        batch.drop_constraint(op.f("ck_images_status"), type_="check")
        batch.drop_column("source_digest")
        batch.drop_column("source_ref")
        batch.drop_column("status_reason")
        batch.drop_column("status")
