"""The analytics views mean the same on SQLite and PostgreSQL: the same data stored in both through the
repository functions, every view queried the same way, the answers compared row by row; and `trajectories`
holds the trajectory `GET /v1/episodes/{id}` shows."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update

from gateway.settings import async_database_url
from migrations.runner import upgrade_database
from storage.calls import write_calls
from storage.database import Database
from storage.episodes import get_transcripts
from storage.models import Episode, JudgeGroup, Reward
from storage.records import CallRecord
from storage.rewards import NewReward, insert_rewards, record_judge_group
from tests.conftest import query
from tests.support.postgres import PostgresServer
from trainer.control.rewards import refresh_episode_rewards

DAY1 = datetime(
    2025, 3, 1, 23, 30, tzinfo=UTC
).timestamp()  # late evening: a zone other than UTC would shift it
DAY2 = datetime(2025, 3, 2, 9, 0, tzinfo=UTC).timestamp()
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


def _reply(text: str | None, tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"content": text, "refusal": None, "role": "assistant"}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "id": "chatcmpl-x",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": "tool_calls" if tool_calls else "stop",
                "logprobs": None,
            }
        ],
    }


def _call(
    call_id: str,
    episode: str,
    messages: list[dict[str, Any]],
    reply: dict[str, Any] | None,
    *,
    at: float,
    policy: str = "bot",
    version: int | None = 1,
    status: str = "ok",
    tokens: tuple[int, int] | None = (10, 5),
    tools: list[dict[str, Any]] | None = None,
    ttft_ms: float | None = None,
) -> CallRecord:
    return CallRecord(
        id=call_id,
        episode_id=episode,
        episode_resolved=True,
        policy=policy,
        model=policy,
        adapter_version=version,
        engine_model=f"{policy}@{version}" if version is not None else policy,
        request={"messages": messages, "tools": tools, "tool_choice": None, "params": {}},
        response=reply,
        usage={"prompt_tokens": tokens[0], "completion_tokens": tokens[1]} if tokens else None,
        latency_ms=100.0 + len(call_id),
        ttft_ms=ttft_ms,
        status=status,
        error={"status": 502, "message": "engine", "code": "bad_gateway"} if status == "error" else None,
        created_at=at,
    )


USER = {"role": "user", "content": "What is 2+2?"}
CALLS = [
    # A two-turn conversation with a tool call: the trajectory is the second call's messages plus its reply.
    _call(
        "c1",
        "e1",
        [USER],
        _reply(None, [{"id": "t1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]),
        at=DAY1,
        tools=TOOLS,
    ),
    _call(
        "c2",
        "e1",
        [
            USER,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "t1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "t1", "content": "4"},
        ],
        _reply("It is 4."),
        at=DAY1 + 1,
        tools=TOOLS,
    ),
    # The last turn failed before any reply: the trajectory ends with the earlier answered turn.
    _call("c3", "e2", [{"role": "user", "content": "hi"}], _reply("hello"), at=DAY1 + 2, version=0),
    _call(
        "c4",
        "e2",
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "more"},
        ],
        None,
        at=DAY2,
        version=1,
        status="error",
        tokens=None,
    ),
    # A streamed call the client left, and traffic of a model no policy owns.
    _call(
        "c5",
        "e3",
        [{"role": "user", "content": "stream"}],
        _reply("part"),
        at=DAY2 + 5,
        status="client_disconnected",
        ttft_ms=12.5,
    ),
    _call(
        "c6",
        "e4",
        [{"role": "user", "content": "plain"}],
        _reply("ok"),
        at=DAY2 + 6,
        policy="gpt-x",
        version=None,
    ),
]


async def _store(url: str) -> None:
    await upgrade_database(async_database_url(url))
    database = Database(async_database_url(url))
    try:
        async with database.session() as session:
            await write_calls(session, CALLS)
        async with database.session() as session:
            rewards = [
                NewReward(source="feedback", value=1.0, episode_id="e1", name="user", idempotency_key="k1"),
                NewReward(source="feedback", value=0.0, call_id="c3", episode_id="e2", idempotency_key="k2"),
                NewReward(source="judge", value=0.25, episode_id="e2", name="ruler", idempotency_key="k3"),
                NewReward(
                    source="feedback", value=1.0, call_id="unknown", status="pending", idempotency_key="k4"
                ),
            ]
            await insert_rewards(session, rewards)
            await refresh_episode_rewards(session, ["e1", "e2"])
            for status, cost, attempts in (("judged", 0.125, 1), ("failed", None, 3)):
                await record_judge_group(
                    session,
                    policy="bot",
                    group_key="g",
                    episode_ids=["e1", "e2"],
                    scorer="judge",
                    model="openai/judge",
                    status=status,
                    attempts=attempts,
                    error=None,
                    latency_ms=40.0 * attempts,
                    cost_usd=cost,
                )
            # Fixed times, so both databases see the same days.
            await session.execute(update(Reward).values(created_at=datetime.fromtimestamp(DAY2, UTC)))
            await session.execute(update(JudgeGroup).values(created_at=datetime.fromtimestamp(DAY1, UTC)))
            await session.execute(update(Episode).values(updated_at=datetime.fromtimestamp(DAY2, UTC)))
            await session.commit()
    finally:
        await database.dispose()


def _normal(value: Any) -> Any:
    """One representation per meaning: SQLite gives text for JSON, dates and timestamps; PostgreSQL types."""
    if isinstance(value, datetime):
        return (value.astimezone(UTC) if value.tzinfo else value).replace(tzinfo=None).isoformat(" ")
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, float):
        return round(value, 9)
    if isinstance(value, str):
        if value[:1] in "[{":
            return json.loads(value)
        if len(value) >= 19 and value[4] == "-" and value[10] == " ":  # a SQLite timestamp
            return datetime.fromisoformat(value).replace(tzinfo=None).isoformat(" ")
    return value


VIEW_QUERIES = {
    "trajectories": "SELECT * FROM trajectories ORDER BY episode_id",
    "traffic_daily": "SELECT * FROM traffic_daily ORDER BY day, policy, adapter_version",
    "rewards_daily": "SELECT * FROM rewards_daily ORDER BY day, source, name, status",
    "judge_daily": "SELECT * FROM judge_daily ORDER BY day, policy, scorer",
}


@pytest.fixture
def both(tmp_path: Path, postgres: PostgresServer) -> dict[str, str]:
    urls = {
        "sqlite": f"sqlite:///{tmp_path / 'views.db'}",
        "postgres": postgres.create_database("v_" + uuid.uuid4().hex[:10]),
    }
    for url in urls.values():
        asyncio.run(_store(url))
    return urls


def test_every_view_answers_the_same_on_sqlite_and_postgresql(both: dict[str, str]) -> None:
    for view, sql in VIEW_QUERIES.items():
        answers = {
            name: [{k: _normal(v) for k, v in row.items()} for row in query(url, sql)]
            for name, url in both.items()
        }
        assert answers["sqlite"], f"{view} is empty"
        for lite, pg in zip(answers["sqlite"], answers["postgres"], strict=True):
            assert lite == pg, view


def test_the_views_hold_what_was_stored(both: dict[str, str]) -> None:
    url = both["sqlite"]
    rows = {
        r["episode_id"]: {k: _normal(v) for k, v in r.items()}
        for r in query(url, VIEW_QUERIES["trajectories"])
    }
    e1, e2, e3 = rows["e1"], rows["e2"], rows["e3"]
    assert (e1["calls"], e1["prompt_tokens"], e1["completion_tokens"], e1["reward"]) == (2, 20, 10, 1.0)
    assert e1["reply"] == "It is 4." and e1["tools"] == TOOLS and e1["served_by"] == "bot@1"
    assert e1["reward_provenance"]["source"] == "feedback" and e1["rewards"] == 1
    # e2's last turn failed: its trajectory is the first turn's, its version and status the last turn's.
    assert e2["messages"][-1] == {"content": "hello", "refusal": None, "role": "assistant"}
    assert (e2["status"], e2["adapter_version"], e2["reply"], e2["reward"]) == ("error", 1, "hello", 0.0)
    assert e3["status"] == "client_disconnected" and e3["reward"] is None

    daily = {
        (r["day"], r["policy"], r["adapter_version"]): r for r in query(url, VIEW_QUERIES["traffic_daily"])
    }
    first = daily[("2025-03-01", "bot", 1)]
    assert (
        first["calls"],
        first["ok"],
        first["episodes"],
        first["rewarded_episodes"],
        first["avg_reward"],
    ) == (2, 2, 1, 1, 1.0)
    second = daily[("2025-03-02", "bot", 1)]
    # c4 (error) and c5 (disconnected) that day; e2 and e3 ended that day on version 1.
    assert (second["calls"], second["errors"], second["disconnected"], second["episodes"]) == (2, 1, 1, 2)
    assert second["avg_ttft_ms"] == 12.5 and second["avg_reward"] == 0.0
    assert daily[("2025-03-01", "bot", 0)]["episodes"] == 0  # e2 began on version 0 but ended on 1

    rewards = {(r["source"], r["name"], r["status"]): r for r in query(url, VIEW_QUERIES["rewards_daily"])}
    assert rewards[("feedback", "user", "linked")]["rewards"] == 2
    assert rewards[("feedback", "user", "pending")]["policy"] is None
    (judge,) = query(url, VIEW_QUERIES["judge_daily"])
    assert (judge["day"], judge["groups_total"], judge["groups_failed"], judge["judge_calls"]) == (
        "2025-03-01",
        2,
        1,
        4,
    )
    assert (judge["episodes"], judge["cost_usd"]) == (4, 0.125)


async def _trajectories(url: str, ids: list[str]) -> dict[str, list[dict[str, Any]]]:
    database = Database(async_database_url(url))
    try:
        async with database.session() as session:
            found = await get_transcripts(session, ids)
    finally:
        await database.dispose()
    return {i: t.messages for i, t in found.items()}


def test_trajectories_match_the_episodes_api(both: dict[str, str]) -> None:
    for url in both.values():
        api = asyncio.run(_trajectories(url, ["e1", "e2", "e3", "e4"]))
        for row in query(url, VIEW_QUERIES["trajectories"]):
            messages = _normal(row["messages"])
            # The API leaves the nulls out of the stored reply; the view shows it as stored.
            messages[-1] = {k: v for k, v in messages[-1].items() if v is not None}
            assert messages == api[row["episode_id"]], row["episode_id"]
