"""signature replays: signed feedback requests already applied, shared by every replica

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.online import Online, OnlineSafety

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ONLINE_SAFETY: OnlineSafety = Online("creates `signature_replays`, which the previous revision never reads")


def upgrade() -> None:
    op.create_table(
        "signature_replays",
        sa.Column("mac", sa.String(length=64), nullable=False),
        sa.Column("timestamp", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("mac"),
    )
    op.create_index(op.f("ix_signature_replays_timestamp"), "signature_replays", ["timestamp"])


def downgrade() -> None:
    op.drop_index(op.f("ix_signature_replays_timestamp"), table_name="signature_replays")
    op.drop_table("signature_replays")
