"""The gateway in front of the scripted upstream, called with the official `openai` SDK, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import query
from tests.support.gateway_server import GatewayServer
from tests.support.openai_schema import validate
from tests.support.scripted_upstream import REFUSAL, THOUGHT, ScriptedUpstream, text_token_ids
from trainer.control.rollouts import carried_options

MakeGateway = Callable[..., GatewayServer]


def client(gw: GatewayServer, **kwargs: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, **kwargs)  # type: ignore[arg-type]


def calls(gw: GatewayServer, url: str) -> list[dict[str, object]]:
    gw.flush()
    rows = query(url, "SELECT * FROM calls ORDER BY created_at")
    for row in rows:  # JSON columns come back as text from SQLite
        for key in (
            "request",
            "response",
            "usage",
            "prompt_token_ids",
            "completion_token_ids",
            "completion_logprobs",
            "error",
        ):
            if isinstance(row[key], str):
                row[key] = json.loads(row[key])
    return rows


def test_non_stream_is_conformant_and_captured(
    make_gateway: MakeGateway, database_url: str, upstream: ScriptedUpstream
) -> None:
    gw = make_gateway(database_url)
    before = len(upstream.requests)
    raw = client(gw).chat.completions.with_raw_response.create(
        model="scripted-1",
        messages=[{"role": "user", "content": "hello there"}],
        temperature=0.5,
        seed=7,
        extra_body={"top_k": 5, "repetition_penalty": 1.1},
    )
    sent = upstream.requests[before].body
    assert (sent["top_k"], sent["repetition_penalty"]) == (5, 1.1)  # unknown fields reach the engine
    assert sent["logprobs"] is True and sent["return_token_ids"] is True  # asked for on every call
    completion = raw.parse()
    assert completion.choices[0].message.content == "echo: hello there"
    assert completion.choices[0].logprobs is None  # asked for by the gateway, not by the client
    validate("CreateChatCompletionResponse", raw.http_response.json())
    request_id = raw.headers["x-request-id"]
    assert completion.id == f"chatcmpl-{request_id}"

    [row] = calls(gw, database_url)
    assert row["id"] == request_id
    assert row["episode_id"] == raw.headers["x-episode-id"]
    assert row["status"] == "ok" and row["position"] == 0 and row["stream"] in (False, 0)
    assert row["request"]["messages"] == [{"role": "user", "content": "hello there"}]
    assert row["request"]["params"]["temperature"] == 0.5 and row["request"]["params"]["seed"] == 7
    assert row["response"]["choices"][0]["message"]["content"] == "echo: hello there"
    assert row["completion_token_ids"] == [text_token_ids("echo: hello there")]
    assert row["completion_logprobs"] == [[-0.0, -0.1, -0.2]]
    assert row["prompt_tokens"] == completion.usage.prompt_tokens  # type: ignore[union-attr]
    assert row["latency_ms"] > 0
    [episode] = query(database_url, "SELECT * FROM episodes")
    assert episode["id"] == row["episode_id"]


def test_client_logprobs_are_returned_when_asked(make_gateway: MakeGateway, database_url: str) -> None:
    gw = make_gateway(database_url)
    raw = client(gw).chat.completions.with_raw_response.create(
        model="scripted-1", messages=[{"role": "user", "content": "a b"}], logprobs=True, top_logprobs=2
    )
    body = raw.http_response.json()
    validate("CreateChatCompletionResponse", body)
    content = body["choices"][0]["logprobs"]["content"]
    assert [entry["logprob"] for entry in content] == [-0.0, -0.1, -0.2]
    assert body["choices"][0]["logprobs"]["refusal"] is None
    assert "token_ids" not in body["choices"][0] and "prompt_token_ids" not in body


def test_stream_is_conformant_and_assembled(make_gateway: MakeGateway, database_url: str) -> None:
    gw = make_gateway(database_url)
    with httpx.stream(
        "POST",
        gw.url + "/v1/chat/completions",
        json={
            "model": "scripted-1",
            "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "#long 12"}],
        },
        timeout=10,
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for chunk in chunks:
        validate("CreateChatCompletionStreamResponse", chunk)
        assert "token_ids" not in json.dumps(chunk)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == " ".join(f"w{i}" for i in range(12))

    [row] = calls(gw, database_url)
    assert row["status"] == "ok" and row["stream"] in (True, 1)
    assert row["response"]["choices"][0]["message"]["content"] == text
    assert row["response"]["choices"][0]["finish_reason"] == "stop"
    assert row["completion_token_ids"] == [text_token_ids(text)]
    assert len(row["completion_logprobs"][0]) == 12
    assert row["usage"]["completion_tokens"] == 12
    assert row["ttft_ms"] is not None and row["ttft_ms"] <= row["latency_ms"]


def test_stream_without_usage_request_hides_usage(make_gateway: MakeGateway, database_url: str) -> None:
    gw = make_gateway(database_url)
    stream = client(gw).chat.completions.create(
        model="scripted-1", stream=True, messages=[{"role": "user", "content": "hi"}]
    )
    chunks = list(stream)
    assert all(c.usage is None for c in chunks)
    [row] = calls(gw, database_url)
    assert row["usage"]["completion_tokens"] == 2  # the gateway still captured it


def test_a_refusal_reaches_the_client_and_the_capture(make_gateway: MakeGateway, database_url: str) -> None:
    gw = make_gateway(database_url)
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "#refuse"}]
    reply = client(gw).chat.completions.create(model="scripted-1", messages=messages)
    assert (reply.choices[0].message.content, reply.choices[0].message.refusal) == (None, REFUSAL)
    chunks = client(gw).chat.completions.create(model="scripted-1", messages=messages, stream=True)
    assert "".join(c.choices[0].delta.refusal or "" for c in chunks if c.choices) == REFUSAL
    assert [row["response"]["choices"][0]["message"] for row in calls(gw, database_url)] == [  # type: ignore[index]
        {"role": "assistant", "content": None, "refusal": REFUSAL}
    ] * 2


def test_n_choices(make_gateway: MakeGateway, database_url: str) -> None:
    gw = make_gateway(database_url)
    completion = client(gw).chat.completions.create(
        model="scripted-1", n=3, messages=[{"role": "user", "content": "x"}]
    )
    assert [c.message.content for c in completion.choices] == [f"echo: x [{i}]" for i in range(3)]
    stream = client(gw).chat.completions.create(
        model="scripted-1", n=2, stream=True, messages=[{"role": "user", "content": "y"}]
    )
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == ["echo: y [0]", "echo: y [1]"]
    rows = calls(gw, database_url)
    assert [len(r["response"]["choices"]) for r in rows] == [3, 2]
    assert [c["message"]["content"] for c in rows[1]["response"]["choices"]] == texts
    assert len(rows[1]["completion_token_ids"]) == 2


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def test_parallel_tool_calls_non_stream(make_gateway: MakeGateway, database_url: str) -> None:
    gw = make_gateway(database_url)
    raw = client(gw).chat.completions.with_raw_response.create(
        model="scripted-1", tools=TOOLS, tool_choice="auto", messages=[{"role": "user", "content": "#tools2"}]
    )
    validate("CreateChatCompletionResponse", raw.http_response.json())
    choice = raw.parse().choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [json.loads(t.function.arguments)["city"] for t in choice.message.tool_calls or []] == [
        "Paris",
        "London",
    ]
    [row] = calls(gw, database_url)
    stored = row["response"]["choices"][0]["message"]["tool_calls"]
    assert [t["function"]["name"] for t in stored] == ["get_weather", "get_weather"]
    assert row["request"]["tools"] == TOOLS and row["request"]["tool_choice"] == "auto"


def test_a_captured_call_gives_a_rollout_the_options_its_turn_repeats(
    make_gateway: MakeGateway, database_url: str
) -> None:
    """The trainer reads a call as the gateway stored it: its forced tool choice, its parallel-calls and
    response-format settings and the app's reply limit all reach the rollout that re-runs that turn."""
    gw = make_gateway(database_url)
    client(gw).chat.completions.create(
        model="scripted-1",
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        response_format={"type": "text"},
        max_completion_tokens=48,
        temperature=0.7,
        messages=[{"role": "user", "content": "#tools2"}],
    )
    [row] = calls(gw, database_url)
    assert carried_options(row["request"]) == {
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "response_format": {"type": "text"},
        "max_tokens": 48,
    }


def test_parallel_tool_calls_streamed(make_gateway: MakeGateway, database_url: str) -> None:
    gw = make_gateway(database_url)
    stream = client(gw).chat.completions.create(
        model="scripted-1", tools=TOOLS, stream=True, messages=[{"role": "user", "content": "#tools2"}]
    )
    args: dict[int, str] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                args[delta.index] = args.get(delta.index, "") + (delta.function.arguments or "")  # type: ignore[union-attr]
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert {i: json.loads(a)["city"] for i, a in args.items()} == {0: "Paris", 1: "London"}
    [row] = calls(gw, database_url)
    stored = row["response"]["choices"][0]["message"]["tool_calls"]
    assert [json.loads(t["function"]["arguments"]) for t in stored] == [{"city": "Paris"}, {"city": "London"}]
    assert all(t["id"] for t in stored)
    assert row["response"]["choices"][0]["finish_reason"] == "tool_calls"


def test_models_health_and_ready(make_gateway: MakeGateway, database_url: str) -> None:
    gw = make_gateway(database_url)
    models = client(gw).models.list()
    assert {m.id for m in models.data} == {"scripted-1", "scripted-2"}
    assert httpx.get(gw.url + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(gw.url + "/readyz")
    assert ready.status_code == 200 and ready.json()["database"] is True


def test_client_request_id_is_kept_and_no_log_stores_nothing(
    make_gateway: MakeGateway, database_url: str
) -> None:
    gw = make_gateway(database_url, admin_key="adm")
    raw = client(
        gw, default_headers={"x-request-id": "my-request-0001"}
    ).chat.completions.with_raw_response.create(
        model="scripted-1", messages=[{"role": "user", "content": "keep"}]
    )
    server_id = raw.headers["x-request-id"]
    assert server_id != "my-request-0001"
    assert raw.headers["x-client-request-id"] == "my-request-0001"
    client(gw, default_headers={"x-kaizen-no-log": "true"}).chat.completions.create(
        model="scripted-1", messages=[{"role": "user", "content": "secret"}]
    )
    rows = calls(gw, database_url)
    assert [(r["id"], r["client_request_id"]) for r in rows] == [(server_id, "my-request-0001")]
    assert "secret" not in json.dumps(query(database_url, "SELECT * FROM episodes"), default=str)
    stats = httpx.get(gw.url + "/admin/capture", headers={"authorization": "Bearer adm"}).json()
    assert stats["opted_out"] == 1 and stats["written"] == 1 and stats["dropped"] == 0


def test_upstream_failures_are_openai_shaped(make_gateway: MakeGateway, database_url: str) -> None:
    gw = make_gateway(database_url)
    for directive, status in (("#error 500", 502), ("#garbage", 502), ("#error 429", 429)):
        response = httpx.post(
            gw.url + "/v1/chat/completions",
            json={"model": "scripted-1", "messages": [{"role": "user", "content": directive}]},
        )
        assert response.status_code == status, directive
        assert response.headers["x-request-id"] and response.headers["x-episode-id"]
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        assert isinstance(response.json()["error"]["code"], str)
    rows = calls(gw, database_url)
    assert [r["status"] for r in rows] == ["error", "error", "error"]


def test_engine_timeout_is_504(make_gateway: MakeGateway, database_url: str) -> None:
    gw = make_gateway(database_url, engine_timeout_s=0.5)
    response = httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": "scripted-1", "messages": [{"role": "user", "content": "#hang"}]},
        timeout=10,
    )
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "engine_timeout"


@pytest.mark.parametrize("keys", [["k1", "k2"]])
def test_api_keys(make_gateway: MakeGateway, keys: list[str], tmp_path: object) -> None:
    gw = make_gateway(f"sqlite:///{tmp_path}/auth.db", api_keys=keys)
    body = {"model": "scripted-1", "messages": [{"role": "user", "content": "x"}]}
    assert httpx.post(gw.url + "/v1/chat/completions", json=body).status_code == 401
    bad = httpx.post(gw.url + "/v1/chat/completions", json=body, headers={"authorization": "Bearer nope"})
    assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
    ok = httpx.post(gw.url + "/v1/chat/completions", json=body, headers={"authorization": "Bearer k2"})
    assert ok.status_code == 200
    assert httpx.get(gw.url + "/healthz").status_code == 200  # probes stay open


def test_nul_characters_in_content_are_captured_losslessly(
    make_gateway: MakeGateway, database_url: str
) -> None:
    gw = make_gateway(database_url)
    text = "before\u0000after"
    reply = client(gw).chat.completions.with_raw_response.create(
        model="scripted-1", messages=[{"role": "user", "content": text}], metadata={"topic": "a\u0000b"}
    )
    assert reply.status_code == 200
    rows = calls(gw, database_url)
    assert [row["id"] for row in rows] == [reply.headers["x-request-id"]]
    assert rows[0]["request"]["messages"][0]["content"] == text  # type: ignore[index]
    episode = httpx.get(f"{gw.url}/v1/episodes/{reply.headers['x-episode-id']}").json()
    assert episode["messages"][0]["content"] == text
    assert episode["metadata"]["topic"] == "a\u0000b"


@pytest.mark.parametrize("param", ["metadata.group_key", "metadata.episode_id", "user"])
def test_nul_in_an_identifier_is_refused_before_serving(
    make_gateway: MakeGateway, database_url: str, upstream: ScriptedUpstream, param: str
) -> None:
    gw = make_gateway(database_url)
    served = len(upstream.requests)
    field = param.removeprefix("metadata.")
    extra: dict[str, object] = {"user": "u\u0000"} if param == "user" else {"metadata": {field: "g\u0000k"}}
    with pytest.raises(openai.BadRequestError) as refused:
        client(gw).chat.completions.create(
            model="scripted-1",
            messages=[{"role": "user", "content": "hi"}],
            **extra,  # type: ignore[arg-type]
        )
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == param, error
    assert len(upstream.requests) == served
    assert calls(gw, database_url) == []


def test_text_that_opens_like_deeply_nested_json_is_served_and_captured(
    make_gateway: MakeGateway, database_url: str
) -> None:
    # Conversations are hashed with JSON text compared by value; text that opens like JSON nested past what the
    # decoder takes (a degenerate reply of brackets) is plain text, not a reason to fail the call after the reply.
    gw = make_gateway(database_url, capture_embeddings=True)
    brackets = "[" * 1000
    sdk = client(gw)
    first = sdk.chat.completions.with_raw_response.create(
        model="scripted-1", messages=[{"role": "user", "content": f"#json {brackets}"}]
    )
    assert first.parse().choices[0].message.content == brackets
    follow_up = sdk.chat.completions.with_raw_response.create(
        model="scripted-1",
        messages=[
            {"role": "user", "content": f"#json {brackets}"},
            {"role": "assistant", "content": brackets},
            {"role": "user", "content": brackets},
        ],
    )
    assert follow_up.headers["x-episode-id"] == first.headers["x-episode-id"]
    chunks = sdk.chat.completions.create(
        model="scripted-1", messages=[{"role": "user", "content": f"#json {brackets}"}], stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == brackets
    for path, field in (
        ("/v1/responses", "input"),
        ("/v1/completions", "prompt"),
        ("/v1/embeddings", "input"),
    ):
        response = httpx.post(gw.url + path, json={"model": "scripted-1", field: brackets}, timeout=30)
        assert response.status_code == 200, (path, response.text)
    rows = calls(gw, database_url)
    assert len(rows) == 6 and {row["status"] for row in rows} == {"ok"}


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "metadata": {"group_key": "g" * 257}},
            "metadata.group_key",
        ),
        ("/v1/responses", {"input": "hi", "metadata": {"group_key": "g\u0000"}}, "metadata.group_key"),
        ("/v1/completions", {"prompt": "hi", "user": "a\u0000b"}, "user"),
        ("/v1/completions", {"prompt": "hi", "metadata": {"group_key": "g" * 257}}, "metadata.group_key"),
        ("/v1/embeddings", {"input": "hi", "user": "a\u0000b"}, "user"),
    ],
)
def test_a_value_the_call_row_cannot_hold_is_refused_before_serving(
    make_gateway: MakeGateway,
    database_url: str,
    upstream: ScriptedUpstream,
    path: str,
    fields: dict[str, object],
    param: str,
) -> None:
    # `calls.user` and `calls.group_key` are bounded text columns: on PostgreSQL a longer value, or a NUL, made
    # the writer drop a call that had been answered.
    gw = make_gateway(database_url, capture_embeddings=True)
    served = len(upstream.requests)
    refused = httpx.post(gw.url + path, json={"model": "scripted-1", **fields}, timeout=30)
    assert refused.status_code == 400, refused.text
    validate("ErrorResponse", refused.json())
    assert refused.json()["error"]["param"] == param
    assert len(upstream.requests) == served
    assert calls(gw, database_url) == []


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/responses", {"input": "hi"}),
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/embeddings", {"input": "hi"}),
    ],
)
def test_a_user_longer_than_its_column_is_served_and_kept_to_its_start(
    make_gateway: MakeGateway, database_url: str, path: str, fields: dict[str, object]
) -> None:
    # The spec sets no limit on `user`: a client sending a long one works unchanged, and its call is stored
    # (it once was dropped by the writer on PostgreSQL) with the first 256 characters.
    gw = make_gateway(database_url, capture_embeddings=True)
    answered = httpx.post(
        gw.url + path, json={"model": "scripted-1", **fields, "user": "u" * 300}, timeout=30
    )
    assert answered.status_code == 200, answered.text
    assert [row["user"] for row in calls(gw, database_url)] == ["u" * 256]


@pytest.mark.parametrize("vllm_quirks", [True, False], ids=["vllm-reasoning", "reasoning_content"])
def test_a_reasoning_models_reasoning_reaches_the_client_and_the_capture(
    make_gateway: MakeGateway, tmp_path: Path, vllm_quirks: bool
) -> None:
    # vLLM's reasoning parsers answer `reasoning` beside the content (DeepSeek's API and older vLLM
    # `reasoning_content`); apps that show or keep the model's thinking read it from there.
    field = "reasoning" if vllm_quirks else "reasoning_content"
    url = f"sqlite:///{tmp_path / 'think.db'}"
    with ScriptedUpstream(vllm_quirks=vllm_quirks) as engine:
        gw = make_gateway(url, upstream_url=engine.url)
        sdk = client(gw)
        messages = [{"role": "user", "content": "#think hi"}]
        raw = sdk.chat.completions.with_raw_response.create(model="scripted-1", messages=messages)  # type: ignore[arg-type]
        validate("CreateChatCompletionResponse", raw.http_response.json())
        message = raw.parse().choices[0].message
        assert (message.content, getattr(message, field)) == ("echo: #think hi", THOUGHT)
        # The follow-up turn sends the reply back as the SDK returned it, thinking included.
        follow_up = sdk.chat.completions.with_raw_response.create(
            model="scripted-1",
            messages=[*messages, message.model_dump(exclude_none=True), {"role": "user", "content": "more"}],  # type: ignore[list-item]
        )
        assert follow_up.headers["x-episode-id"] == raw.headers["x-episode-id"]
        thought, content = "", ""
        for chunk in sdk.chat.completions.create(model="scripted-1", messages=messages, stream=True):  # type: ignore[arg-type]
            validate("CreateChatCompletionStreamResponse", chunk.model_dump(exclude_unset=True))
            for choice in chunk.choices:
                thought += getattr(choice.delta, field, None) or ""
                content += choice.delta.content or ""
        assert (thought, content) == (THOUGHT, "echo: #think hi")
        rows = calls(gw, url)
    stored = [row["response"]["choices"][0]["message"] for row in rows]  # type: ignore[index]
    assert [m.get(field) for m in stored] == [THOUGHT, None, THOUGHT]
    episode = httpx.get(f"{gw.url}/v1/episodes/{raw.headers['x-episode-id']}", timeout=10).json()
    assert episode["messages"][1][field] == THOUGHT
