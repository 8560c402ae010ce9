"""the project that owns a policy: only its keys call it, only its episodes train it (NULL: shared)

Revision ID: 0022
Revises: 0021
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.online import Online, OnlineSafety

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ONLINE_SAFETY: OnlineSafety = Online(
    "adds nullable `policies.project`, which the previous revision never reads; every policy stored before it "
    "stays shared, so gateways of the previous revision, which do not check owners, serve them as before"
)


def upgrade() -> None:
    # Policies created before owners existed trained on every project's episodes: they stay shared.
    with op.batch_alter_table("policies") as batch:
        batch.add_column(sa.Column("project", sa.String(length=128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("policies") as batch:
        batch.drop_column("project")
