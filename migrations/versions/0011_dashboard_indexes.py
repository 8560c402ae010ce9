"""indexes for the dashboard's lists and time series: per-policy traffic, episodes by policy, reward and time

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from migrations.online import Online, OnlineSafety

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ONLINE_SAFETY: OnlineSafety = Online(
    "builds four B-tree indexes on `calls`, `episodes` and `rewards`: writes to each wait for its build "
    "(seconds at a million rows: the capture writer's in the capture log, a feedback request in its call)"
)

# (name, table, columns): each serves one dashboard query on large tables (docs/dashboard.md#scale).
INDEXES = (
    # Overview per policy: calls of one policy in a time window.
    ("ix_calls_policy_created_at", "calls", ["policy", "created_at"]),
    # Live reward per policy, and the episode list filtered by policy, newest first.
    ("ix_episodes_policy_created_at", "episodes", ["policy", "created_at"]),
    # The review queue (unrewarded first, newest first) and the reward-range filter.
    ("ix_episodes_reward_created_at", "episodes", ["reward", "created_at"]),
    # "Has feedback": one probe per episode for a reward of a given source.
    ("ix_rewards_episode_id_source", "rewards", ["episode_id", "source"]),
)


def upgrade() -> None:
    for name, table, columns in INDEXES:
        op.create_index(name, table, columns, unique=False)


def downgrade() -> None:
    for name, table, _ in reversed(INDEXES):
        op.drop_index(name, table_name=table)
