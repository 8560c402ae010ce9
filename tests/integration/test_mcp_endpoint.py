"""`/mcp/<policy>`: the gateway as an MCP server of a policy's tools, called with the official `mcp` SDK over
streamable HTTP, under the keys, scopes and model allow-lists of `/v1`; each call recorded in its episode."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from gateway.settings import async_database_url
from storage.database import Database
from storage.policies import get_policy, update_policy_config
from tests.conftest import query
from tests.integration.test_feedback import add_policy
from tests.support.gateway_server import GatewayServer
from tests.support.polling import wait_until_async

ADMIN = {"Authorization": "Bearer admin-key"}
TOOLS = {
    "servers": [
        {"name": "atlas", "command": [sys.executable, "-m", "tests.support.mcp_tools"], "timeout_s": 60}
    ],
    "functions": ["tests.support.tool_functions:capital", "tests.support.tool_functions:sleepy"],
    "timeout_s": 1.0,
}
MakeGateway = Callable[..., GatewayServer]


async def session_calls(
    url: str, key: str, episode: str | None, calls: list[tuple[str, dict[str, Any]]]
) -> tuple[list[str], list[tuple[str, bool]]]:
    """List the tools, then make `calls`, as an app does with the SDK; returns names and (text, is_error)."""
    import httpx2
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    headers = {"Authorization": f"Bearer {key}"}
    if episode is not None:
        headers["X-Episode-Id"] = episode
    async with (
        httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(60.0)) as http,
        streamable_http_client(url, http_client=http) as (read, write),
        ClientSession(read, write, read_timeout_seconds=60) as session,
    ):
        await session.initialize()
        listed = await session.list_tools()
        answers = []
        for name, arguments in calls:
            result = await session.call_tool(name, arguments)
            answers.append((result.content[0].text, bool(result.is_error)))  # type: ignore[union-attr]
        return [t.name for t in listed.tools], answers


def test_an_app_lists_and_calls_the_policys_tools_into_its_episode(
    make_gateway: MakeGateway, database_url: str
) -> None:
    # The router does not re-read policies during the test: the policy's first tool calls come before it would
    # have seen the policy, and must be redacted all the same.
    gw = make_gateway(database_url, admin_key="admin-key", api_keys="app-key", policy_refresh_s=3600)
    add_policy(database_url, "agent", {"tools": TOOLS, "privacy": {"mode": "mask"}})
    calls = [
        ("lookup", {"key": "zorland"}),
        ("capital", {"country": "vellmar"}),
        ("lookup", {"key": "mars"}),  # the server's own error
        ("capital", {"country": "atlantis"}),  # the function raises
        ("sleepy", {"seconds": 5}),  # past the time limit
        ("weather", {}),  # no such tool
        ("lookup", {"key": "me@example.com"}),  # redacted where it is stored
    ]
    names, answers = asyncio.run(session_calls(f"{gw.url}/mcp/agent", "app-key", "ep-agent-1", calls))
    assert names == ["lookup", "slow", "broken", "capital", "sleepy"]
    assert answers[:2] == [("capital: Quix", False), ("Ostra", False)]
    assert answers[2] == ("no entry for 'mars'", True)
    assert answers[3][1] and "KeyError" in answers[3][0]
    assert answers[4] == ("Error: sleepy did not answer within 1 s", True)
    assert answers[5] == ("Error: there is no tool named 'weather'", True)

    rows = query(
        database_url,
        "SELECT episode_id, policy, tool, source, is_error, key_id, project, result FROM tool_calls ORDER BY created_at",
    )
    assert [(r["episode_id"], r["policy"], r["tool"], bool(r["is_error"])) for r in rows] == [
        ("ep-agent-1", "agent", name, error) for (name, _), (_, error) in zip(calls, answers, strict=True)
    ]
    assert [r["source"] for r in rows[:2]] == ["atlas", "function"] and rows[0]["key_id"] == "env"
    assert rows[-1]["result"] == "no entry for '[EMAIL]'"

    # The episode's chat calls and its tool calls are one episode.
    chat = httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": "scripted-1", "messages": [{"role": "user", "content": "what is the capital?"}]},
        headers={"Authorization": "Bearer app-key", "X-Episode-Id": "ep-agent-1"},
        timeout=30,
    )
    assert chat.status_code == 200, chat.text
    gw.flush()
    episode = httpx.get(
        gw.url + "/v1/episodes/ep-agent-1", headers={"Authorization": "Bearer app-key"}
    ).json()
    assert [c["tool"] for c in episode["tool_calls"]] == [name for name, _ in calls]
    assert episode["tool_calls"][0]["result"] == "capital: Quix" and episode["tool_calls"][0][
        "arguments"
    ] == {"key": "zorland"}


@pytest.mark.parametrize(
    ("path", "key", "status", "code"),
    [
        ("/mcp/agent", None, 401, "invalid_api_key"),
        ("/mcp/agent", "wrong-key", 401, "invalid_api_key"),
        ("/mcp/nobody", "app-key", 404, "policy_not_found"),
        ("/mcp", "app-key", 404, "policy_not_found"),
        ("/mcp/agent", "narrow", 403, "model_not_allowed"),
    ],
)
def test_refusals_are_openai_shaped_and_come_before_any_tool(
    make_gateway: MakeGateway, database_url: str, path: str, key: str | None, status: int, code: str
) -> None:
    gw = make_gateway(database_url, admin_key="admin-key", api_keys="app-key")
    add_policy(database_url, "agent", {"tools": {"functions": ["tests.support.tool_functions:capital"]}})
    if key == "narrow":
        created = httpx.post(
            gw.url + "/admin/keys", json={"name": "n", "scopes": ["chat"], "models": ["other"]}, headers=ADMIN
        )
        assert created.status_code == 201, created.text
        key = created.json()["secret"]
    headers = {"Accept": "application/json, text/event-stream"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "capital", "arguments": {"country": "zorland"}},
    }
    answer = httpx.post(gw.url + path, json=body, headers=headers, timeout=30)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["code"] == code
    assert query(database_url, "SELECT count(*) AS n FROM tool_calls")[0]["n"] == 0


def test_a_changed_tools_section_is_offered_after_the_refresh(
    make_gateway: MakeGateway, tmp_path: Any
) -> None:
    url = f"sqlite:///{tmp_path}/tools.db"
    gw = make_gateway(url, policy_refresh_s=0.2)
    add_policy(url, "agent", {"tools": {"functions": ["tests.support.tool_functions:capital"]}})
    first, _ = asyncio.run(session_calls(f"{gw.url}/mcp/agent", "unused", None, []))
    assert first == ["capital"]

    async def change() -> None:
        database = Database(async_database_url(url))
        try:
            async with database.session() as session:
                policy = await get_policy(session, "agent")
                assert policy is not None
                tools = {"functions": ["tests.support.tool_functions:essay"]}
                await update_policy_config(session, policy.id, {**policy.config, "tools": tools})
                await session.commit()
        finally:
            await database.dispose()

    asyncio.run(change())

    async def offered() -> bool:
        names, _ = await session_calls(f"{gw.url}/mcp/agent", "unused", None, [])
        return names == ["essay"]

    asyncio.run(wait_until_async(offered, "the new tools to be offered", timeout_s=30))
