"""the source of an episode: live traffic, or a tool that wrote it (a bootstrap run, an import)

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.online import Online, OnlineSafety

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ONLINE_SAFETY: OnlineSafety = Online(
    "adds `episodes.source` with a constant default (no rewrite); writes to `episodes` (the capture "
    "writer's, feedback's) wait for the build of its index, seconds at a million episodes; the previous "
    "revision's episodes are traffic"
)


def upgrade() -> None:
    # Every episode stored before this revision came from traffic through the gateway.
    with op.batch_alter_table("episodes") as batch:
        batch.add_column(sa.Column("source", sa.String(length=32), server_default="traffic", nullable=False))
    op.create_index("ix_episodes_source", "episodes", ["source"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_episodes_source", table_name="episodes")
    with op.batch_alter_table("episodes") as batch:
        batch.drop_column("source")
