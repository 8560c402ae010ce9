"""rollouts (canary, split, shadow), version pins, shadow pairs and when a version first served

Revision ID: 0023
Revises: 0022
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.online import Online, OnlineSafety

revision: str = "0023"
down_revision: str | None = "0022"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ONLINE_SAFETY: OnlineSafety = Online(
    "adds three tables and nullable `adapters.serving_since`, none of which the previous revision reads; its "
    "gateways keep serving each policy's active version to every call while a newer gateway runs a rollout"
)


def upgrade() -> None:
    with op.batch_alter_table("adapters") as batch:
        batch.add_column(sa.Column("serving_since", sa.DateTime(timezone=True), nullable=True))
    op.create_table(
        "rollouts",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column(
            "policy_id", sa.Integer(), sa.ForeignKey("policies.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("mode", sa.String(length=16), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("baseline_version", sa.Integer(), nullable=True),
        sa.Column("share", sa.Float(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=True),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("stats", sa.JSON(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("actor", sa.String(length=256), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("decided_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_rollouts_policy_status", "rollouts", ["policy_id", "status"])
    op.create_table(
        "version_pins",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column(
            "policy_id", sa.Integer(), sa.ForeignKey("policies.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("scope", sa.String(length=16), nullable=False),
        sa.Column("subject", sa.String(length=128), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("actor", sa.String(length=256), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("policy_id", "scope", "subject"),
    )
    op.create_table(
        "shadow_pairs",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column(
            "rollout_id", sa.Integer(), sa.ForeignKey("rollouts.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("call_id", sa.String(length=64), nullable=False),
        sa.Column("messages", sa.JSON(), nullable=False),
        sa.Column("served", sa.JSON(), nullable=False),
        sa.Column("shadow", sa.JSON(), nullable=False),
        sa.Column("served_reward", sa.Float(), nullable=True),
        sa.Column("shadow_reward", sa.Float(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("scored_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_shadow_pairs_rollout_id", "shadow_pairs", ["rollout_id"])


def downgrade() -> None:
    op.drop_index("ix_shadow_pairs_rollout_id", table_name="shadow_pairs")
    op.drop_table("shadow_pairs")
    op.drop_table("version_pins")
    op.drop_index("ix_rollouts_policy_status", table_name="rollouts")
    op.drop_table("rollouts")
    with op.batch_alter_table("adapters") as batch:
        batch.drop_column("serving_since")
