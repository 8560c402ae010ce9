"""analytics views: one row per trajectory, and traffic, rewards and judging per day

Revision ID: 0012
Revises: 0011

The views read plain columns of `episodes`, `calls`, `rewards` and `judge_groups` only (no JSON paths in
joins or filters), so they keep working when those tables are partitioned or rebuilt; a migration that
replaces one of these tables must drop the views first and create them again afterwards (`drop_views` and
`create_views` below). The SQL differs per database only where the dialects do (JSON access, calendar days in
UTC); each column means the same on SQLite and PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from migrations.online import Online, OnlineSafety

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ONLINE_SAFETY: OnlineSafety = Online(
    "creates views; `CREATE VIEW` takes no lock that stops reads or writes of the tables it reads"
)

VIEWS = ("trajectories", "traffic_daily", "rewards_daily", "judge_daily")

# Dialect fragments. `{x}` is a column expression.
_SQLITE = {
    # Timestamps are stored as UTC text ("2025-01-31 23:59:59.123456"): the day is its date part.
    "day": "date({x})",
    "reply": "{x} -> '$.choices[0].message'",
    "reply_text": "{x} ->> '$.choices[0].message.content'",
    "messages": "{x} -> '$.messages'",
    "with_reply": "json_insert({req} -> '$.messages', '$[#]', {resp} -> '$.choices[0].message')",
    "tools": "CASE WHEN json_type({x}, '$.tools') = 'array' THEN {x} -> '$.tools' END",
}
_POSTGRESQL = {
    "day": "CAST(timezone('UTC', {x}) AS DATE)",
    "reply": "{x} -> 'choices' -> 0 -> 'message'",
    "reply_text": "{x} -> 'choices' -> 0 -> 'message' ->> 'content'",
    "messages": "CAST({x} -> 'messages' AS JSONB)",
    "with_reply": "CAST({req} -> 'messages' AS JSONB) || "
    "jsonb_build_array(CAST({resp} -> 'choices' -> 0 -> 'message' AS JSONB))",
    "tools": "CASE WHEN json_typeof({x} -> 'tools') = 'array' THEN CAST({x} -> 'tools' AS JSONB) END",
}

# The call of an episode with the highest position: its last turn.
_LAST_CALL = (
    "l.episode_id = e.id AND l.position = (SELECT max(c.position) FROM calls c WHERE c.episode_id = e.id)"
)


def _trajectories(f: dict[str, str]) -> str:
    # `a` is the last call that has a reply (a call that failed before the engine answered has none): the
    # trajectory is its messages plus that reply, as `GET /v1/episodes/{id}` builds it.
    answered = f["reply"].format(x="c.response")
    return f"""
CREATE VIEW trajectories AS
SELECT
    e.id AS episode_id,
    e.policy,
    e.project,
    e.source,
    e.group_key,
    e.created_at,
    e.updated_at,
    (SELECT count(*) FROM calls c WHERE c.episode_id = e.id) AS calls,
    (SELECT min(c.created_at) FROM calls c WHERE c.episode_id = e.id) AS first_call_at,
    l.created_at AS last_call_at,
    l.model,
    l.adapter_version,
    l.engine_model AS served_by,
    l.status,
    CASE WHEN a.id IS NOT NULL THEN {f["with_reply"].format(req="a.request", resp="a.response")}
         ELSE {f["messages"].format(x="l.request")} END AS messages,
    CASE WHEN a.id IS NOT NULL THEN {f["tools"].format(x="a.request")}
         ELSE {f["tools"].format(x="l.request")} END AS tools,
    {f["reply_text"].format(x="a.response")} AS reply,
    (SELECT sum(c.prompt_tokens) FROM calls c WHERE c.episode_id = e.id) AS prompt_tokens,
    (SELECT sum(c.completion_tokens) FROM calls c WHERE c.episode_id = e.id) AS completion_tokens,
    (SELECT sum(c.latency_ms) FROM calls c WHERE c.episode_id = e.id) AS latency_ms,
    e.reward,
    e.reward_provenance,
    (SELECT count(*) FROM rewards r WHERE r.episode_id = e.id AND r.status = 'linked') AS rewards,
    e.metadata,
    e.tags
FROM episodes e
JOIN calls l ON {_LAST_CALL}
LEFT JOIN calls a ON a.episode_id = e.id AND a.position = (
    SELECT max(c.position) FROM calls c WHERE c.episode_id = e.id AND {answered} IS NOT NULL
)
"""


def _traffic_daily(f: dict[str, str]) -> str:
    # Calls and episodes have different grains: each contributes its own rows, and the day groups them. An
    # episode counts on the day, and for the version, of its last turn.
    return f"""
CREATE VIEW traffic_daily AS
SELECT
    traffic.day,
    traffic.policy,
    traffic.adapter_version,
    sum(traffic.is_call) AS calls,
    sum(traffic.ok) AS ok,
    sum(traffic.errors) AS errors,
    sum(traffic.disconnected) AS disconnected,
    avg(traffic.latency_ms) AS avg_latency_ms,
    max(traffic.latency_ms) AS max_latency_ms,
    avg(traffic.ttft_ms) AS avg_ttft_ms,
    sum(traffic.prompt_tokens) AS prompt_tokens,
    sum(traffic.completion_tokens) AS completion_tokens,
    sum(traffic.is_episode) AS episodes,
    count(traffic.reward) AS rewarded_episodes,
    avg(traffic.reward) AS avg_reward
FROM (
    SELECT
        {f["day"].format(x="c.created_at")} AS day,
        c.policy,
        c.adapter_version,
        1 AS is_call,
        CASE WHEN c.status = 'ok' THEN 1 ELSE 0 END AS ok,
        CASE WHEN c.status = 'error' THEN 1 ELSE 0 END AS errors,
        CASE WHEN c.status = 'client_disconnected' THEN 1 ELSE 0 END AS disconnected,
        c.latency_ms,
        c.ttft_ms,
        c.prompt_tokens,
        c.completion_tokens,
        0 AS is_episode,
        CAST(NULL AS DOUBLE PRECISION) AS reward
    FROM calls c
    UNION ALL
    SELECT
        {f["day"].format(x="l.created_at")},
        e.policy,
        l.adapter_version,
        0,
        0,
        0,
        0,
        CAST(NULL AS DOUBLE PRECISION),
        CAST(NULL AS DOUBLE PRECISION),
        CAST(NULL AS INTEGER),
        CAST(NULL AS INTEGER),
        1,
        e.reward
    FROM episodes e
    JOIN calls l ON {_LAST_CALL}
) AS traffic
GROUP BY traffic.day, traffic.policy, traffic.adapter_version
"""


def _rewards_daily(f: dict[str, str]) -> str:
    day = f["day"].format(x="r.created_at")
    return f"""
CREATE VIEW rewards_daily AS
SELECT
    {day} AS day,
    e.policy,
    r.source,
    r.name,
    r.status,
    count(*) AS rewards,
    avg(r.value) AS avg_value,
    min(r.value) AS min_value,
    max(r.value) AS max_value
FROM rewards r
LEFT JOIN episodes e ON e.id = r.episode_id
GROUP BY {day}, e.policy, r.source, r.name, r.status
"""


def _judge_daily(f: dict[str, str]) -> str:
    day = f["day"].format(x="j.created_at")
    return f"""
CREATE VIEW judge_daily AS
SELECT
    {day} AS day,
    j.policy,
    j.scorer,
    j.model,
    count(*) AS groups_total,
    sum(CASE WHEN j.status = 'judged' THEN 1 ELSE 0 END) AS groups_judged,
    sum(CASE WHEN j.status = 'failed' THEN 1 ELSE 0 END) AS groups_failed,
    sum(j.attempts) AS judge_calls,
    sum(json_array_length(j.episode_ids)) AS episodes,
    sum(j.cost_usd) AS cost_usd,
    avg(j.latency_ms) AS avg_latency_ms
FROM judge_groups j
GROUP BY {day}, j.policy, j.scorer, j.model
"""


def create_views() -> None:
    fragments = _POSTGRESQL if op.get_bind().dialect.name == "postgresql" else _SQLITE
    for build in (_trajectories, _traffic_daily, _rewards_daily, _judge_daily):
        op.execute(build(fragments))


def drop_views() -> None:
    for name in reversed(VIEWS):
        op.execute(f"DROP VIEW IF EXISTS {name}")


def upgrade() -> None:
    create_views()


def downgrade() -> None:
    drop_views()
