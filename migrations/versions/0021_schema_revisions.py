"""schema revisions applied, with whether each was safe to run while the previous revision served

Revision ID: 0021
Revises: 0020

`kaizen db upgrade` and `kaizen serve` record every revision the database went through here (the ones applied
before this revision too, when they first run after it), so that a gateway whose code is older than the
database can tell whether the revisions it does not know were all online-safe (then it serves) or not.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.online import Online, OnlineSafety

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ONLINE_SAFETY: OnlineSafety = Online("creates `schema_revisions`, which the previous revision never reads")


def upgrade() -> None:
    op.create_table(
        "schema_revisions",
        sa.Column("revision", sa.String(length=32), nullable=False),
        sa.Column("previous", sa.String(length=32), nullable=True),
        sa.Column("online_safe", sa.Boolean(), nullable=False),
        sa.Column("note", sa.Text(), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("revision"),
    )


def downgrade() -> None:
    op.drop_table("schema_revisions")
