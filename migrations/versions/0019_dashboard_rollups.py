"""dashboard at a million calls: 15-minute rollups, version and text search indexes, ended dashboard sessions

Revision ID: 0019
Revises: 0015

- `traffic_rollups`, `rollup_marks`, `rollup_state`: the overview's sums per 15-minute bucket, policy and
  serving version, and what must be summed again (`storage/rollups.py`). Created empty: the first refresh
  sums the existing rows (about the cost of one 30-day overview before this revision).
- `ix_calls_adapter_version_created_at`: the newest call of a version, where the episode list filtered by
  version starts (instead of walking every newer episode).
- PostgreSQL only: `pg_trgm` and trigram indexes on the text of `calls.request` and `calls.response`, so a
  text search finds rare strings through the index (SQLite searches a bounded window instead; see
  docs/dashboard.md). The extension is trusted (PostgreSQL 13+): the database's owner may create it. Building
  the indexes reads the whole table once (minutes at a million calls); writes to `calls` wait meanwhile.
- `dashboard_logouts`: sessions ended before their cookie expired.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.online import Offline, OnlineSafety

revision: str = "0019"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ONLINE_SAFETY: OnlineSafety = Offline(
    "builds trigram indexes over the text of every call: writes to `calls` wait for minutes at a million "
    "calls, and meanwhile the capture backs up in the log and a conversation's next turn answered by another "
    "replica starts a new episode instead of joining its own",
    dialects=("postgresql",),
)

TRIGRAM_INDEXES = (("ix_calls_request_trgm", "request"), ("ix_calls_response_trgm", "response"))


def upgrade() -> None:
    op.create_table(
        "traffic_rollups",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("bucket_start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("policy", sa.String(length=128), nullable=False),
        sa.Column("adapter_version", sa.Integer(), nullable=True),
        sa.Column("calls", sa.Integer(), nullable=False),
        sa.Column("errors", sa.Integer(), nullable=False),
        sa.Column("latency_ms_sum", sa.Float(), nullable=False),
        sa.Column("latency_ms_max", sa.Float(), nullable=True),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("episodes", sa.Integer(), nullable=False),
        sa.Column("rewarded", sa.Integer(), nullable=False),
        sa.Column("reward_sum", sa.Float(), nullable=False),
        sa.Column("feedback", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_traffic_rollups_bucket_start", "traffic_rollups", ["bucket_start"], unique=False)
    op.create_index(
        "ix_traffic_rollups_policy_bucket", "traffic_rollups", ["policy", "bucket_start"], unique=False
    )
    op.create_table(
        "rollup_marks",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("since", sa.DateTime(timezone=True), nullable=False),
        sa.Column("until", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "rollup_state",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("rolled_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("refreshed_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "dashboard_logouts",
        sa.Column("nonce", sa.String(length=64), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("nonce"),
    )
    op.create_index("ix_dashboard_logouts_expires_at", "dashboard_logouts", ["expires_at"], unique=False)
    op.create_index(
        "ix_calls_adapter_version_created_at", "calls", ["adapter_version", "created_at"], unique=False
    )
    if op.get_bind().dialect.name == "postgresql":
        op.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")
        for name, column in TRIGRAM_INDEXES:
            op.execute(f"CREATE INDEX {name} ON calls USING gin ((CAST({column} AS TEXT)) gin_trgm_ops)")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for name, _ in TRIGRAM_INDEXES:
            op.execute(f"DROP INDEX {name}")
    op.drop_index("ix_calls_adapter_version_created_at", table_name="calls")
    op.drop_index("ix_dashboard_logouts_expires_at", table_name="dashboard_logouts")
    op.drop_table("dashboard_logouts")
    op.drop_table("rollup_state")
    op.drop_table("rollup_marks")
    op.drop_index("ix_traffic_rollups_policy_bucket", table_name="traffic_rollups")
    op.drop_index("ix_traffic_rollups_bucket_start", table_name="traffic_rollups")
    op.drop_table("traffic_rollups")
