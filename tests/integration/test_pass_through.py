"""Well-formed request shapes the gateway has no use for are forwarded to the engine untouched: prompt caching
hints on content parts, custom tools, `allowed_tools` tool choice. Only what the spec calls malformed is
refused (those cases are in test_bad_input.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import query
from tests.support.gateway_server import GatewayServer
from tests.support.openai_schema import validate
from tests.support.scripted_upstream import ScriptedUpstream

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
SQL = {
    "type": "custom",
    "custom": {
        "name": "run_sql",
        "description": "Run one SQL query",
        "format": {"type": "grammar", "grammar": {"syntax": "lark", "definition": "start: /SELECT .+/"}},
    },
}
FREE_TEXT = {"type": "custom", "custom": {"name": "note", "format": {"type": "text"}}}

CASES: dict[str, dict[str, Any]] = {
    "cache_control on text parts": {
        "messages": [
            {
                "role": "system",
                "content": [{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}],
            },
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral", "ttl": "5m"}},
                    {"type": "text", "text": "there", "prompt_cache_breakpoint": {"mode": "explicit"}},
                ],
            },
        ]
    },
    "custom tools": {"tools": [WEATHER, SQL, FREE_TEXT]},
    "custom tool choice": {
        "tools": [WEATHER, SQL],
        "tool_choice": {"type": "custom", "custom": {"name": "run_sql"}},
    },
    "allowed_tools": {
        "tools": [WEATHER, SQL],
        "tool_choice": {
            "type": "allowed_tools",
            "allowed_tools": {
                "mode": "required",
                "tools": [{"type": "function", "function": {"name": "get_weather"}}],
            },
        },
    },
    "unknown top-level field": {
        "prompt_cache_key": "tenant-7",
        "safety_identifier": "u-1",
        "verbosity": "low",
    },
}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, upstream: ScriptedUpstream) -> Iterator[GatewayServer]:
    from gateway.settings import Settings

    data = tmp_path_factory.mktemp("pass-through")
    settings = Settings.load(
        data_dir=data,
        database_url=f"sqlite:///{data / 'k.db'}",
        engine="upstream",
        upstream_url=upstream.url,
        port=0,
        capture_flush_ms=5.0,
        scheduler=False,
    )
    server = GatewayServer(settings).start()
    yield server
    server.stop()


@pytest.mark.parametrize("fields", CASES.values(), ids=CASES.keys())
def test_well_formed_new_shapes_are_forwarded_untouched(
    gateway: GatewayServer, upstream: ScriptedUpstream, fields: dict[str, Any]
) -> None:
    sent = {"model": "scripted-1", "messages": [{"role": "user", "content": "hi"}], **fields}
    before = len(upstream.requests)
    response = httpx.post(gateway.url + "/v1/chat/completions", json=sent)
    assert response.status_code == 200, response.text
    validate("CreateChatCompletionResponse", response.json())
    [received] = upstream.chat_requests()[before:]
    for name, value in fields.items():
        assert received[name] == value, name
    gateway.flush()
    [row] = query(
        gateway.settings.database_url,
        "SELECT request FROM calls WHERE id = :id",
        id=response.headers["x-request-id"],
    )
    assert '"messages"' in str(row["request"])
