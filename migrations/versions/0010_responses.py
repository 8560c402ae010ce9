"""stored responses of POST /v1/responses, for GET and previous_response_id

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.online import Online, OnlineSafety

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ONLINE_SAFETY: OnlineSafety = Online("creates `responses`, which the previous revision never reads")


def upgrade() -> None:
    op.create_table(
        "responses",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("call_id", sa.String(length=64), nullable=False),
        sa.Column("previous_response_id", sa.String(length=64), nullable=True),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("input_items", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_responses_call_id", "responses", ["call_id"], unique=False)
    op.create_index("ix_responses_created_at", "responses", ["created_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_responses_created_at", table_name="responses")
    op.drop_index("ix_responses_call_id", table_name="responses")
    op.drop_table("responses")
