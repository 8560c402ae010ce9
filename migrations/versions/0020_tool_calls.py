"""tool calls through the gateway's MCP endpoint, with their episode

Revision ID: 0020
Revises: 0019
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.online import Online, OnlineSafety

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ONLINE_SAFETY: OnlineSafety = Online("creates `tool_calls`, which the previous revision never reads")


def upgrade() -> None:
    op.create_table(
        "tool_calls",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("episode_id", sa.String(length=64), nullable=True),
        sa.Column("policy", sa.String(length=128), nullable=False),
        sa.Column("tool", sa.String(length=64), nullable=False),
        sa.Column("source", sa.String(length=64), nullable=False),
        sa.Column("arguments", sa.JSON(), nullable=False),
        sa.Column("result", sa.Text(), nullable=False),
        sa.Column("is_error", sa.Boolean(), nullable=False),
        sa.Column("latency_ms", sa.Float(), nullable=False),
        sa.Column("key_id", sa.String(length=64), nullable=True),
        sa.Column("project", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_tool_calls_policy", "tool_calls", ["policy"], unique=False)
    op.create_index("ix_tool_calls_created_at", "tool_calls", ["created_at"], unique=False)
    op.create_index(
        "ix_tool_calls_episode_id_created_at", "tool_calls", ["episode_id", "created_at"], unique=False
    )


def downgrade() -> None:
    op.drop_index("ix_tool_calls_episode_id_created_at", table_name="tool_calls")
    op.drop_index("ix_tool_calls_created_at", table_name="tool_calls")
    op.drop_index("ix_tool_calls_policy", table_name="tool_calls")
    op.drop_table("tool_calls")
