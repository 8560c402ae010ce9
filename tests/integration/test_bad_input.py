"""Bad input gets a 4xx in OpenAI's error shape and writes nothing (no call row, no upstream request)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import query
from tests.support.gateway_server import GatewayServer
from tests.support.scripted_upstream import ScriptedUpstream

USER = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "scripted-1", "messages": USER, **fields}


# (case id, request body (bytes or JSON), extra headers, expected status, expected `param` or None)
CASES: list[tuple[str, Any, dict[str, str], int, str | None]] = [
    ("malformed json", b'{"model": "scripted-1", "messages": [', {}, 400, None),
    ("body is an array", [1, 2], {}, 400, None),
    ("body is a string", "hello", {}, 400, None),
    ("empty body", b"", {}, 400, None),
    ("missing model", {"messages": USER}, {}, 400, None),
    ("model not a string", body(model=12), {}, 400, "model"),
    ("empty model", body(model=""), {}, 400, "model"),
    ("missing messages", {"model": "scripted-1"}, {}, 400, None),
    ("empty messages", body(messages=[]), {}, 400, "messages"),
    ("messages not a list", body(messages="hi"), {}, 400, "messages"),
    ("message not an object", body(messages=[1]), {}, 400, "messages[0]"),
    ("unknown role", body(messages=[{"role": "wizard", "content": "x"}]), {}, 400, "messages[0].role"),
    ("missing role", body(messages=[{"content": "x"}]), {}, 400, "messages[0]"),
    ("content wrong type", body(messages=[{"role": "user", "content": 5}]), {}, 400, "messages[0].content"),
    (
        "unknown content part",
        body(messages=[{"role": "user", "content": [{"type": "video"}]}]),
        {},
        400,
        None,
    ),
    ("tool message without id", body(messages=[{"role": "tool", "content": "r"}]), {}, 400, "messages[0]"),
    (
        "tool call without its type",
        body(
            messages=[
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}],
                }
            ]
        ),
        {},
        400,
        "messages[0].tool_calls[0]",
    ),
    (
        "text part without its type",
        body(messages=[{"role": "system", "content": [{"text": "be brief"}]}, *USER]),
        {},
        400,
        "messages[0].content[0]",
    ),
    (
        "assistant message with neither content nor tool calls",
        body(messages=[*USER, {"role": "assistant", "content": None, "tool_calls": None}, *USER]),
        {},
        400,
        "messages[1]",
    ),
    (
        "image part without its url",
        body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"detail": "low"}}]}]),
        {},
        400,
        "messages[0].content[0].image_url",
    ),
    (
        "image detail not one of the spec's",
        body(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "x", "detail": "max"}}],
                }
            ]
        ),
        {},
        400,
        "messages[0].content[0].image_url.detail",
    ),
    ("unknown reasoning_effort", body(reasoning_effort="extreme"), {}, 400, "reasoning_effort"),
    ("n zero", body(n=0), {}, 400, "n"),
    ("n above the cap", body(n=100), {}, 400, "n"),
    ("n wrong type", body(n="2"), {}, 400, "n"),
    ("temperature too high", body(temperature=3), {}, 400, "temperature"),
    ("top_p above one", body(top_p=1.5), {}, 400, "top_p"),
    ("max_tokens zero", body(max_tokens=0), {}, 400, "max_tokens"),
    ("max_tokens wrong type", body(max_tokens="ten"), {}, 400, "max_tokens"),
    ("too many stop sequences", body(stop=["a", "b", "c", "d", "e"]), {}, 400, "stop"),
    ("top_logprobs without logprobs", body(top_logprobs=2), {}, 400, "top_logprobs"),
    ("top_logprobs above 20", body(logprobs=True, top_logprobs=21), {}, 400, "top_logprobs"),
    ("tool without a name", body(tools=[{"type": "function", "function": {}}]), {}, 400, "tools[0].function"),
    ("tool name with spaces", body(tools=[{"type": "function", "function": {"name": "a b"}}]), {}, 400, None),
    ("unknown tool_choice", body(tool_choice="sometimes"), {}, 400, "tool_choice"),
    (
        "named tool_choice without tools",
        body(tool_choice={"type": "function", "function": {"name": "f"}}),
        {},
        400,
        "tool_choice",
    ),
    (
        "named tool_choice for a tool not given",
        body(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "other"}}),
        {},
        400,
        "tool_choice",
    ),
    ("tool without a type", body(tools=[{"function": {"name": "f"}}]), {}, 400, "tools[0]"),
    (
        "custom tool without a name",
        body(tools=[{"type": "custom", "custom": {}}]),
        {},
        400,
        "tools[0].custom",
    ),
    (
        "custom tool with an unknown format",
        body(tools=[{"type": "custom", "custom": {"name": "sql", "format": {"type": "regex"}}}]),
        {},
        400,
        "tools[0].custom.format.type",
    ),
    (
        "allowed_tools with an unknown mode",
        body(
            tools=[WEATHER],
            tool_choice={"type": "allowed_tools", "allowed_tools": {"mode": "sometimes", "tools": []}},
        ),
        {},
        400,
        "tool_choice.allowed_tools.mode",
    ),
    (
        "allowed_tools without its tools",
        body(tools=[WEATHER], tool_choice={"type": "allowed_tools", "allowed_tools": {"mode": "auto"}}),
        {},
        400,
        "tool_choice.allowed_tools",
    ),
    (
        "allowed_tools naming a tool not given",
        body(
            tools=[WEATHER],
            tool_choice={
                "type": "allowed_tools",
                "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "function": {"name": "x"}}]},
            },
        ),
        {},
        400,
        "tool_choice.allowed_tools",
    ),
    (
        "custom tool_choice for a tool not given",
        body(tools=[WEATHER], tool_choice={"type": "custom", "custom": {"name": "sql"}}),
        {},
        400,
        "tool_choice",
    ),
    (
        "text part without its text",
        body(
            messages=[{"role": "user", "content": [{"type": "text", "cache_control": {"type": "ephemeral"}}]}]
        ),
        {},
        400,
        "messages[0].content[0]",
    ),
    ("unknown response_format", body(response_format={"type": "xml"}), {}, 400, "response_format.type"),
    ("json_schema format, no json_schema", body(response_format={"type": "json_schema"}), {}, 400, None),
    (
        "json_schema name not a string",
        body(
            response_format={"type": "json_schema", "json_schema": {"name": 5, "schema": {"type": "object"}}}
        ),
        {},
        400,
        "response_format.json_schema.name",
    ),
    (
        "json_schema strict not a bool",
        body(response_format={"type": "json_schema", "json_schema": {"name": "a", "strict": "yes"}}),
        {},
        400,
        "response_format.json_schema.strict",
    ),
    (
        "json_schema schema not an object",
        body(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}}),
        {},
        400,
        "response_format.json_schema.schema",
    ),
    (
        "json_schema schema not a JSON Schema",
        body(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "x"}}}),
        {},
        400,
        "response_format.json_schema.schema",
    ),
    (
        "function parameters not a JSON Schema",
        body(
            tools=[
                WEATHER,
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"properties": {"q": "string"}}},
                },
            ]
        ),
        {},
        400,
        "tools[1].function.parameters",
    ),
    ("logit_bias key not a token id", body(logit_bias={"role": 1}), {}, 400, None),
    ("unknown modality", body(modalities=["text", "video"]), {}, 400, "modalities[1]"),
    ("prediction of an unknown type", body(prediction={"type": "diff", "content": "x"}), {}, 400, None),
    ("user content an empty list", body(messages=[{"role": "user", "content": []}]), {}, 400, None),
    (
        "system content an empty list",
        body(messages=[{"role": "system", "content": []}, {"role": "user", "content": "hi"}]),
        {},
        400,
        None,
    ),
    ("stream not a bool", body(stream="yes"), {}, 400, "stream"),
    (
        "stream_options without stream",
        body(stream_options={"include_usage": True}),
        {},
        400,
        "stream_options",
    ),
    ("metadata value not a string", body(metadata={"k": 1}), {}, 400, None),
    ("invalid episode id header", body(), {"x-episode-id": "bad id with spaces"}, 400, None),
    ("invalid metadata episode id", body(metadata={"episode_id": "x" * 100}), {}, 400, "metadata.episode_id"),
    ("unknown model", body(model="no-such-model"), {}, 404, "model"),
    ("body too large", body(messages=[{"role": "user", "content": "x" * 70_000}]), {}, 413, None),
]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, upstream: ScriptedUpstream) -> Iterator[GatewayServer]:
    from gateway.settings import Settings

    data = tmp_path_factory.mktemp("bad-input")
    settings = Settings.load(
        data_dir=data,
        database_url=f"sqlite:///{data / 'k.db'}",
        engine="upstream",
        upstream_url=upstream.url,
        port=0,
        max_body_bytes=64 * 1024,
        capture_flush_ms=5.0,
        scheduler=False,
    )
    server = GatewayServer(settings).start()
    yield server
    server.stop()


@pytest.mark.parametrize(
    ("payload", "headers", "status", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input(
    gateway: GatewayServer,
    upstream: ScriptedUpstream,
    payload: Any,
    headers: dict[str, str],
    status: int,
    param: str | None,
) -> None:
    before = len(upstream.requests)
    content = payload if isinstance(payload, bytes) else httpx.Request("POST", "/", json=payload).content
    response = httpx.post(
        gateway.url + "/v1/chat/completions",
        content=content,
        headers={"content-type": "application/json", **headers},
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == (
        "not_found_error" if status == 404 else "invalid_request_error"
    )
    assert error["code"] is None or isinstance(error["code"], str)
    if param is not None:
        assert error["param"] == param
    gateway.flush()
    assert len(upstream.requests) == before
    assert query(gateway.settings.database_url, "SELECT count(*) AS n FROM calls") == [{"n": 0}]
    assert gateway.services.sink.snapshot()["queued"] == 0


def test_wrong_method_and_route_are_openai_shaped(gateway: GatewayServer) -> None:
    for response, status in (
        (httpx.get(gateway.url + "/v1/chat/completions"), 405),
        (httpx.post(gateway.url + "/v1/nope", json={}), 404),
    ):
        assert response.status_code == status
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_case_count() -> None:
    assert len(CASES) >= 25


MakeGateway = Callable[..., GatewayServer]


def test_unknown_model_writes_nothing_on_postgres(
    make_gateway: MakeGateway, postgres: Any, tmp_path: Path
) -> None:
    url = postgres.create_database("bad_input_pg")
    gw = make_gateway(url)
    response = httpx.post(gw.url + "/v1/chat/completions", json=body(model="nope"))
    assert response.status_code == 404
    gw.flush()
    assert query(url, "SELECT count(*) AS n FROM calls") == [{"n": 0}]
    assert query(url, "SELECT count(*) AS n FROM episodes") == [{"n": 0}]
