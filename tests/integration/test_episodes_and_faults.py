"""Episodes (stitching, explicit ids), client disconnects and a database outage, through the live gateway."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import openai
from sqlalchemy import update

from gateway.housekeeping import Housekeeping
from gateway.settings import async_database_url
from storage.database import Database
from storage.models import Call, Episode
from tests.conftest import query
from tests.integration.test_chat_capture import calls, client
from tests.support.gateway_server import GatewayServer
from tests.support.postgres import PostgresServer

MakeGateway = Callable[..., GatewayServer]


def converse(gw: GatewayServer, messages: list[Any], **kwargs: Any) -> tuple[str, str]:
    raw = client(gw).chat.completions.with_raw_response.create(
        model="scripted-1", messages=messages, **kwargs
    )
    reply = raw.parse().choices[0].message
    messages.append(reply.model_dump(exclude_none=True))  # what apps do with the SDK
    return raw.headers["x-episode-id"], raw.headers["x-request-id"]


def test_prefix_stitching(make_gateway: MakeGateway, database_url: str) -> None:
    gw = make_gateway(database_url)
    messages: list[Any] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "first"}]
    episode, _ = converse(gw, messages)
    messages.append({"role": "user", "content": "second"})
    assert converse(gw, messages)[0] == episode
    messages.append({"role": "user", "content": "third"})
    assert converse(gw, messages)[0] == episode
    other, _ = converse(gw, [{"role": "user", "content": "first"}])
    assert other != episode  # same user text, different system prompt: a new conversation

    rows = calls(gw, database_url)
    assert [(r["episode_id"], r["position"]) for r in rows] == [
        (episode, 0),
        (episode, 1),
        (episode, 2),
        (other, 0),
    ]
    assert len({r["context_hash"] for r in rows[:3]}) == 1


def test_tool_loop_stitches_when_the_client_reserialises_arguments(
    make_gateway: MakeGateway, database_url: str
) -> None:
    """A tool loop as the AI SDK sends it: the engine's `{"city": "Paris"}` comes back as `{"city":"Paris"}`,
    and the text as content parts; it is still one episode."""
    gw = make_gateway(database_url)
    messages: list[Any] = [{"role": "user", "content": "weather? #tool"}]
    first = client(gw).chat.completions.with_raw_response.create(model="scripted-1", messages=messages)
    [call] = first.parse().choices[0].message.tool_calls or []
    assert call.function.arguments == '{"city": "Paris"}'  # type: ignore[union-attr]
    messages += [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": [{"type": "text", "text": "sunny"}]},
    ]
    second = client(gw).chat.completions.with_raw_response.create(model="scripted-1", messages=messages)
    episode = first.headers["x-episode-id"]
    assert second.headers["x-episode-id"] == episode
    rows = calls(gw, database_url)
    assert [(r["episode_id"], r["position"]) for r in rows] == [(episode, 0), (episode, 1)]


def test_stitching_survives_a_restart(make_gateway: MakeGateway, database_url: str) -> None:
    first = make_gateway(database_url)
    messages: list[Any] = [{"role": "user", "content": "remember me"}]
    episode, _ = converse(first, messages)
    first.flush()
    first.stop()
    second = make_gateway(database_url)
    messages.append({"role": "user", "content": "again"})
    assert converse(second, messages)[0] == episode
    rows = calls(second, database_url)
    assert [(r["episode_id"], r["position"]) for r in rows] == [(episode, 0), (episode, 1)]


def test_explicit_episode_ids(make_gateway: MakeGateway, database_url: str) -> None:
    gw = make_gateway(database_url)
    tagged = openai.OpenAI(
        base_url=gw.url + "/v1", api_key="x", max_retries=0, default_headers={"x-episode-id": "run-42"}
    )
    for text in ("plan", "act"):
        raw = tagged.chat.completions.with_raw_response.create(
            model="scripted-1", messages=[{"role": "user", "content": text}]
        )
        assert raw.headers["x-episode-id"] == "run-42"
    via_metadata, _ = converse(
        gw, [{"role": "user", "content": "m"}], metadata={"episode_id": "run-43", "group_key": "task-7"}
    )
    assert via_metadata == "run-43"
    rows = calls(gw, database_url)
    assert [(r["episode_id"], r["position"]) for r in rows] == [("run-42", 0), ("run-42", 1), ("run-43", 0)]
    assert rows[2]["group_key"] == "task-7"
    [episode] = query(database_url, "SELECT group_key FROM episodes WHERE id = 'run-43'")
    assert episode["group_key"] == "task-7"


def test_an_episode_with_turns_still_queued_is_not_served_half_written(
    make_gateway: MakeGateway, database_url: str
) -> None:
    """A judge or a training run reads an episode once it is served whole: while a later turn waits in the capture
    queue, reading the episode answers 409 (retry), not the turns stored so far; editing it works as stored."""
    gw = make_gateway(database_url, capture_flush_ms=3000.0)  # each turn waits about 3 s in the queue
    tagged = openai.OpenAI(
        base_url=gw.url + "/v1", api_key="x", max_retries=0, default_headers={"x-episode-id": "agent-run"}
    )

    def read() -> httpx.Response:
        return httpx.get(f"{gw.url}/v1/episodes/agent-run", timeout=10)

    def wait_for_turns(count: int) -> dict[str, Any]:
        deadline = time.monotonic() + 30
        while (answer := read()).status_code == 409 and time.monotonic() < deadline:
            assert answer.json()["error"]["code"] == "episode_not_written"
            time.sleep(0.1)
        assert answer.status_code == 200, answer.text
        episode: dict[str, Any] = answer.json()
        assert len(episode["turns"]) == count
        return episode

    tagged.chat.completions.create(model="scripted-1", messages=[{"role": "user", "content": "plan"}])
    wait_for_turns(1)
    tagged.chat.completions.create(model="scripted-1", messages=[{"role": "user", "content": "act"}])
    half = read()
    assert half.status_code == 409, half.text
    assert half.json()["error"]["code"] == "episode_not_written"
    assert half.headers["retry-after"]
    # An edit is not held back: the agent may tag its run while the latest turn is on its way.
    edited = httpx.put(f"{gw.url}/v1/episodes/agent-run", json={"tags": ["mid-run"]}, timeout=10)
    assert edited.status_code == 200 and edited.json()["tags"] == ["mid-run"], edited.text
    assert wait_for_turns(2)["tags"] == ["mid-run"]


def test_client_disconnect_mid_stream_is_recorded(make_gateway: MakeGateway, database_url: str) -> None:
    gw = make_gateway(database_url)
    payload = {
        "model": "scripted-1",
        "stream": True,
        "messages": [{"role": "user", "content": "#long 30 #slow 100"}],
    }
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=payload, timeout=10) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]
    assert any(line.startswith("data: ") for line in received)
    deadline = time.monotonic() + 10
    rows: list[dict[str, Any]] = []
    while time.monotonic() < deadline and not rows:
        rows = calls(gw, database_url)
        time.sleep(0.1)
    [row] = rows
    assert row["status"] == "client_disconnected"
    content = row["response"]["choices"][0]["message"]["content"]
    assert content.startswith("w0") and "w29" not in content


def test_database_outage_loses_nothing(make_gateway: MakeGateway, postgres: PostgresServer) -> None:
    url = postgres.create_database("outage")
    gw = make_gateway(url, admin_key="adm")
    ids: list[str] = []

    def send(n: int) -> None:
        for i in range(n):
            raw = client(gw).chat.completions.with_raw_response.create(
                model="scripted-1", messages=[{"role": "user", "content": f"call {len(ids)} {i}"}]
            )
            assert raw.http_response.status_code == 200
            ids.append(raw.headers["x-request-id"])

    send(5)
    gw.flush()
    postgres.stop()
    try:
        send(20)  # every call still succeeds for the client
        gw.flush()
        stats = httpx.get(gw.url + "/admin/capture", headers={"authorization": "Bearer adm"}).json()
        assert stats["spooled"] >= 1 and stats["database_up"] is False
        # Streams too.
        stream = client(gw).chat.completions.create(
            model="scripted-1", stream=True, messages=[{"role": "user", "content": "during outage"}]
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    finally:
        postgres.start()
        postgres.wait_ready()
    deadline = time.monotonic() + 30
    stats = {}
    while time.monotonic() < deadline:
        stats = httpx.get(gw.url + "/admin/capture", headers={"authorization": "Bearer adm"}).json()
        if stats["spool_bytes"] == 0 and stats["database_up"]:
            break
        time.sleep(0.2)
    assert stats["spool_bytes"] == 0 and stats["dropped"] == 0 and stats["replayed"] >= 1
    rows = query(url, "SELECT id FROM calls")
    assert len(rows) == 26
    assert {r["id"] for r in rows} >= set(ids)


def test_retention_prunes_calls_no_policy_owns(make_gateway: MakeGateway, database_url: str) -> None:
    gw = make_gateway(database_url)
    old_episode, old_call = converse(gw, [{"role": "user", "content": "confidential old text"}])
    new_episode, new_call = converse(gw, [{"role": "user", "content": "recent text"}])
    gw.flush()
    assert len(calls(gw, database_url)) == 2
    assert query(database_url, "SELECT name FROM policies") == []  # an upstream model: no policy row

    async def prune() -> tuple[int, int]:
        database = Database(async_database_url(database_url))
        try:
            async with database.session() as session:
                old = datetime.now(UTC) - timedelta(days=40)
                await session.execute(update(Call).where(Call.id == old_call).values(created_at=old))
                await session.execute(update(Episode).where(Episode.id == old_episode).values(created_at=old))
                await session.commit()
            return await Housekeeping(database, 30, None).prune_unowned_calls()
        finally:
            await database.dispose()

    assert asyncio.run(prune()) == (1, 1)
    assert [row["id"] for row in calls(gw, database_url)] == [new_call]
    gone = httpx.get(f"{gw.url}/v1/episodes/{old_episode}")  # deleted, not "still in the capture queue"
    assert gone.status_code == 404, gone.text
    assert gone.json()["error"]["code"] == "episode_not_found"
    assert set(gone.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(f"{gw.url}/v1/episodes/{new_episode}").status_code == 200
    if database_url.startswith("sqlite"):
        wal = Path(database_url.removeprefix("sqlite:///") + "-wal")
        assert b"confidential old text" not in (wal.read_bytes() if wal.exists() else b"")
