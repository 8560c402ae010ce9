"""managed API keys, the project of episodes, the key of calls and rewards, and the audit log

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.online import Online, OnlineSafety

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ONLINE_SAFETY: OnlineSafety = Online(
    "creates `api_keys` and `audit`, adds nullable columns and `episodes.project` with a constant default "
    "(no rewrite); writes to `episodes` (the capture writer's, feedback's) wait for the build of its index, "
    "seconds at a million episodes. The previous revision's episodes get the built-in project, where its keys "
    "belong"
)


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("hash", sa.String(length=64), nullable=False),
        sa.Column("scopes", sa.JSON(), nullable=False),
        sa.Column("project", sa.String(length=128), nullable=False),
        sa.Column("models", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("hash"),
    )
    op.create_table(
        "audit",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor", sa.String(length=256), nullable=False),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("target", sa.String(length=256), nullable=False),
        sa.Column("details", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(op.f("ix_audit_at"), "audit", ["at"])
    op.create_index(op.f("ix_audit_action"), "audit", ["action"])
    op.create_index(op.f("ix_audit_target"), "audit", ["target"])
    # Episodes written before keys had projects belong to the built-in project of the environment keys.
    # Plain ADD COLUMN (no table copy on SQLite): a nullable column, or one with a server default.
    op.add_column(
        "episodes", sa.Column("project", sa.String(length=128), server_default="default", nullable=False)
    )
    op.create_index(op.f("ix_episodes_project"), "episodes", ["project"])
    op.add_column("calls", sa.Column("key_id", sa.String(length=64), nullable=True))
    op.add_column("rewards", sa.Column("key_id", sa.String(length=64), nullable=True))
    op.add_column("rewards", sa.Column("project", sa.String(length=128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("rewards") as batch:
        batch.drop_column("project")
        batch.drop_column("key_id")
    with op.batch_alter_table("calls") as batch:
        batch.drop_column("key_id")
    op.drop_index(op.f("ix_episodes_project"), table_name="episodes")
    with op.batch_alter_table("episodes") as batch:
        batch.drop_column("project")
    op.drop_index(op.f("ix_audit_target"), table_name="audit")
    op.drop_index(op.f("ix_audit_action"), table_name="audit")
    op.drop_index(op.f("ix_audit_at"), table_name="audit")
    op.drop_table("audit")
    op.drop_table("api_keys")
