"""one job lock: training runs hold the policy's `job_locks` row; `training_locks` is dropped

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.online import Offline, OnlineSafety

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ONLINE_SAFETY: OnlineSafety = Offline(
    "drops `training_locks`, where a training run of the previous revision takes its lock: its scheduled "
    "and manual runs fail until it is stopped (calls are unaffected)"
)


def upgrade() -> None:
    op.drop_table("training_locks")


def downgrade() -> None:
    op.create_table(
        "training_locks",
        sa.Column("policy_id", sa.Integer(), nullable=False),
        sa.Column("owner", sa.String(length=128), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=True),
        sa.Column("acquired_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["policy_id"], ["policies.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("policy_id"),
    )
