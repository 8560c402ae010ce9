"""rewards: link status of feedback, and judge_groups

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.online import Online, OnlineSafety

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ONLINE_SAFETY: OnlineSafety = Online(
    "adds `rewards.status` with a constant default (no table rewrite) and `judge_groups`; the index on "
    "`rewards.status` makes feedback writes wait for its build (seconds at a million rewards); the previous "
    "revision's rewards get `linked`, what they were"
)


def upgrade() -> None:
    with op.batch_alter_table("rewards", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("status", sa.String(length=16), server_default="linked", nullable=False)
        )
        batch_op.create_index(batch_op.f("ix_rewards_status"), ["status"], unique=False)

    op.create_table(
        "judge_groups",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("policy", sa.String(length=128), nullable=True),
        sa.Column("group_key", sa.String(length=256), nullable=False),
        sa.Column("episode_ids", sa.JSON(), nullable=False),
        sa.Column("scorer", sa.String(length=16), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("latency_ms", sa.Float(), nullable=True),
        sa.Column("cost_usd", sa.Float(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("judge_groups", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_judge_groups_created_at"), ["created_at"], unique=False)
        batch_op.create_index(batch_op.f("ix_judge_groups_policy"), ["policy"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("judge_groups", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_judge_groups_policy"))
        batch_op.drop_index(batch_op.f("ix_judge_groups_created_at"))
    op.drop_table("judge_groups")
    with op.batch_alter_table("rewards", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_rewards_status"))
        batch_op.drop_column("status")
