"""Initial schema (every primary key is the row's natural key).

Revision ID: 0001
Revises: 
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _stamps() -> list[sa.Column]:
    """``run_id``, ``created_at`` and ``updated_at`` (forgeflow.store._Stamped)."""
    return [
        sa.Column("run_id", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    ]


def upgrade() -> None:
    """Create every table of the store."""
    op.create_table(
        "images",
        sa.Column("ref", sa.String(length=512), nullable=False),
        sa.Column("digest", sa.String(length=80), nullable=True),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=True),
        sa.Column("project", sa.String(length=256), nullable=True),
        *_stamps(),
        sa.CheckConstraint(
            "role IN ('source', 'target', 'basecache', 'task', 'env')", name=op.f("ck_images_role")
        ),
        sa.PrimaryKeyConstraint("ref", name=op.f("pk_images")),
    )
    op.create_table(
        "task_instances",
        sa.Column("instance_id", sa.String(length=512), nullable=False),
        sa.Column("repo", sa.String(length=256), nullable=False),
        sa.Column("patch_sha256", sa.String(length=64), nullable=True),
        sa.Column("image_ref", sa.String(length=512), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("fail_to_pass", sa.JSON(), nullable=False),
        sa.Column("pass_to_pass", sa.JSON(), nullable=False),
        *_stamps(),
        sa.CheckConstraint(
            "status IN ('candidate', 'accepted', 'rejected', 'error')",
            name=op.f("ck_task_instances_status"),
        ),
        sa.PrimaryKeyConstraint("instance_id", name=op.f("pk_task_instances")),
    )
    op.create_index(op.f("ix_task_instances_repo"), "task_instances", ["repo"])
    op.create_index(op.f("ix_task_instances_status"), "task_instances", ["status"])
    op.create_table(
        "batches",
        sa.Column("batch_id", sa.String(length=512), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("instance_ids", sa.JSON(), nullable=False),
        sa.Column("concurrency", sa.Integer(), nullable=False),
        *_stamps(),
        sa.PrimaryKeyConstraint("batch_id", name=op.f("pk_batches")),
    )
    op.create_table(
        "trials",
        sa.Column("trial_id", sa.String(length=512), nullable=False),
        sa.Column("instance_id", sa.String(length=512), nullable=False),
        sa.Column("batch_id", sa.String(length=512), nullable=True),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("job_id", sa.String(length=512), nullable=True),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("exception_type", sa.String(length=128), nullable=True),
        sa.Column("exception_message", sa.Text(), nullable=True),
        sa.Column("timings", sa.JSON(), nullable=False),
        sa.Column("model_sha256", sa.String(length=64), nullable=True),
        *_stamps(),
        sa.CheckConstraint("kind IN ('nop', 'oracle', 'agent')", name=op.f("ck_trials_kind")),
        sa.PrimaryKeyConstraint("trial_id", name=op.f("pk_trials")),
    )
    op.create_index(op.f("ix_trials_instance_id"), "trials", ["instance_id"])
    op.create_index(op.f("ix_trials_job_id"), "trials", ["job_id"])
    op.create_table(
        "freezes",
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("semantic_sha256", sa.String(length=64), nullable=False),
        sa.Column("file_sha256", sa.String(length=64), nullable=False),
        sa.Column("manifest_path", sa.Text(), nullable=False),
        sa.Column("counts", sa.JSON(), nullable=False),
        *_stamps(),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_freezes")),
    )
    op.create_table(
        "model_artifacts",
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("quantization", sa.String(length=32), nullable=True),
        sa.Column("parent_sha256", sa.String(length=64), nullable=True),
        sa.Column("lineage", sa.JSON(), nullable=False),
        *_stamps(),
        sa.CheckConstraint(
            "kind IN ('base', 'adapter', 'merged', 'gguf')", name=op.f("ck_model_artifacts_kind")
        ),
        sa.PrimaryKeyConstraint("sha256", name=op.f("pk_model_artifacts")),
    )
    op.create_index(op.f("ix_model_artifacts_parent_sha256"), "model_artifacts", ["parent_sha256"])
    op.create_table(
        "serving_generations",
        sa.Column("generation", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("port", sa.Integer(), nullable=False),
        sa.Column("gguf_sha256", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        *_stamps(),
        sa.CheckConstraint(
            "status IN ('active', 'retired', 'rolled_back')",
            name=op.f("ck_serving_generations_status"),
        ),
        sa.PrimaryKeyConstraint("generation", name=op.f("pk_serving_generations")),
    )


def downgrade() -> None:
    """Drop every table of the store."""
    op.drop_table("serving_generations")
    op.drop_index(op.f("ix_model_artifacts_parent_sha256"), table_name="model_artifacts")
    op.drop_table("model_artifacts")
    op.drop_table("freezes")
    op.drop_index(op.f("ix_trials_job_id"), table_name="trials")
    op.drop_index(op.f("ix_trials_instance_id"), table_name="trials")
    op.drop_table("trials")
    op.drop_table("batches")
    op.drop_index(op.f("ix_task_instances_status"), table_name="task_instances")
    op.drop_index(op.f("ix_task_instances_repo"), table_name="task_instances")
    op.drop_table("task_instances")
    op.drop_table("images")
