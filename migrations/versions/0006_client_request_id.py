"""client request ids: a call's id is always server-generated; the client's `x-request-id` is kept beside it

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.online import Online, OnlineSafety

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ONLINE_SAFETY: OnlineSafety = Online(
    "adds a nullable column to `calls` (no rewrite) and an index on it, whose build makes the capture "
    "writer wait (seconds at a million calls; the calls wait in the capture log); the previous revision keeps "
    "storing the client's id as the call id, which feedback still finds"
)


def upgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.add_column(sa.Column("client_request_id", sa.String(length=64), nullable=True))
    op.create_index("ix_calls_client_request_id", "calls", ["client_request_id"], unique=False)
    # No backfill: a call stored before this revision has the client's id (when one was sent) as its own id,
    # and feedback looks a request id up as a server id first.


def downgrade() -> None:
    op.drop_index("ix_calls_client_request_id", table_name="calls")
    with op.batch_alter_table("calls") as batch:
        batch.drop_column("client_request_id")
