"""The scripted upstream does what its directives say; integration tests and the benchmark rely on it."""

from __future__ import annotations

import itertools
import json
import socket
import statistics
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageFunctionToolCall

from tests.support.scripted_upstream import ScriptedUpstream


@pytest.fixture(scope="module")
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream() as server:
        yield server


@pytest.fixture(scope="module")
def conformant() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream(vllm_quirks=False) as server:
        yield server


@pytest.fixture
def client(upstream: ScriptedUpstream) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=upstream.url, timeout=10) as http:
        yield http


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "scripted-1", "messages": [{"role": "user", "content": text}], **extra}


def sse_events(body: str) -> list[Any]:
    """Parse an SSE body strictly: every event is one ``data:`` line followed by a blank line."""
    assert body.endswith("data: [DONE]\n\n")
    events = body.split("\n\n")[:-1]
    assert all(event.startswith("data: ") for event in events)
    return [json.loads(event[6:]) for event in events[:-1]]


def tid(word: str) -> int:
    return zlib.crc32(word.encode()) % 50_000


def test_health_and_models(client: httpx.Client, upstream: ScriptedUpstream) -> None:
    assert httpx.get(f"{upstream.root_url}/health").status_code == 200
    models = client.get("/models").json()
    assert [m["id"] for m in models["data"]] == ["scripted-1", "scripted-2"]


def test_echo_through_openai_sdk_with_vllm_quirks(upstream: ScriptedUpstream) -> None:
    sdk = openai.OpenAI(base_url=upstream.url, api_key="unused")
    raw = sdk.chat.completions.with_raw_response.create(
        model="scripted-2", messages=[{"role": "user", "content": "hello world"}]
    )
    completion = raw.parse()
    assert completion.choices[0].message.content == "echo: hello world"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.model == "scripted-2"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (2, 3)
    body = json.loads(raw.http_response.text)
    message = body["choices"][0]
    assert message["message"]["annotations"] is None
    assert message["message"]["function_call"] is None
    assert body["usage"]["prompt_tokens_details"] is None
    assert "stop_reason" in message
    assert message["token_ids"] is None


def test_last_user_message_scripts_the_reply_and_requests_are_recorded(
    client: httpx.Client, upstream: ScriptedUpstream
) -> None:
    before = len(upstream.requests)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "#tool"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "plain"}, {"type": "text", "text": "parts"}]},
    ]
    body = {"model": "scripted-1", "messages": messages}
    reply = client.post("/chat/completions", json=body, headers={"X-Episode-Id": "ep-7"}).json()
    assert reply["choices"][0]["message"]["content"] == "echo: plain parts"
    record = upstream.requests[before]
    assert record.body == body
    assert record.headers["x-episode-id"] == "ep-7"
    assert record.outcome == "completed"
    assert reply["usage"]["prompt_tokens"] == 6


@pytest.mark.parametrize(("directive", "cities"), [("#tool", ["Paris"]), ("#tools2", ["Paris", "London"])])
def test_tool_calls(upstream: ScriptedUpstream, directive: str, cities: list[str]) -> None:
    sdk = openai.OpenAI(base_url=upstream.url, api_key="unused")
    choice = sdk.chat.completions.create(
        model="scripted-1", messages=[{"role": "user", "content": directive}]
    ).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = [
        c for c in choice.message.tool_calls or [] if isinstance(c, ChatCompletionMessageFunctionToolCall)
    ]
    assert len(calls) == len(choice.message.tool_calls or [])
    assert [(c.function.name, json.loads(c.function.arguments)["city"]) for c in calls] == [
        ("get_weather", city) for city in cities
    ]
    assert len({c.id for c in calls}) == len(cities)


def test_json_directive_and_tool_results_script_the_reply(client: httpx.Client) -> None:
    reply = client.post("/chat/completions", json=chat('#json {"city": "Paris", "days": 3}')).json()
    assert json.loads(reply["choices"][0]["message"]["content"]) == {"city": "Paris", "days": 3}
    messages = [
        {"role": "user", "content": "#tool"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    reply = client.post("/chat/completions", json={"model": "scripted-1", "messages": messages}).json()
    assert reply["choices"][0]["message"]["content"] == "echo: sunny"
    assert reply["choices"][0]["finish_reason"] == "stop"


def test_agent_calls_a_tool_each_turn_then_answers_from_the_results(upstream: ScriptedUpstream) -> None:
    sdk = openai.OpenAI(base_url=upstream.url, api_key="unused")
    messages: list[Any] = [{"role": "user", "content": "weather report #agent 2"}]
    cities = []
    for _ in range(2):
        message = sdk.chat.completions.create(model="scripted-1", messages=messages).choices[0].message
        [call] = [c for c in message.tool_calls or [] if isinstance(c, ChatCompletionMessageFunctionToolCall)]
        cities.append(json.loads(call.function.arguments)["city"])
        messages += [
            message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": f"{cities[-1]}: sunny"},
        ]
    final = sdk.chat.completions.create(model="scripted-1", messages=messages).choices[0]
    assert cities == ["Paris", "London"]
    assert (final.finish_reason, final.message.content) == ("stop", "done: Paris: sunny | London: sunny")


def test_streamed_tool_calls_assemble_through_the_sdk(upstream: ScriptedUpstream) -> None:
    sdk = openai.OpenAI(base_url=upstream.url, api_key="unused")
    stream = sdk.chat.completions.create(
        model="scripted-1", stream=True, messages=[{"role": "user", "content": "#tools2"}]
    )
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    deltas_with_arguments = 0
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or []:
                if call.function and call.function.name:
                    names[call.index] = call.function.name
                if call.function and call.function.arguments:
                    arguments[call.index] = arguments.get(call.index, "") + call.function.arguments
                    deltas_with_arguments += 1
    assert names == {0: "get_weather", 1: "get_weather"}
    assert {i: json.loads(a) for i, a in arguments.items()} == {0: {"city": "Paris"}, 1: {"city": "London"}}
    assert deltas_with_arguments == 4
    assert finish == "tool_calls"


def test_long_stream_matches_non_stream_and_reports_usage(client: httpx.Client) -> None:
    full = client.post("/chat/completions", json=chat("#long 50", return_token_ids=True)).json()
    content = full["choices"][0]["message"]["content"]
    assert content == " ".join(f"w{i}" for i in range(50))
    events = sse_events(
        client.post(
            "/chat/completions",
            json=chat("#long 50", stream=True, stream_options={"include_usage": True}, return_token_ids=True),
        ).text
    )
    role, *chunks, usage = events
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["prompt_token_ids"] == full["prompt_token_ids"] == [tid("#long"), tid("50")]
    assert len(chunks) == 50
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == content
    assert [i for c in chunks for i in c["choices"][0]["token_ids"]] == full["choices"][0]["token_ids"]
    # vLLM puts finish_reason on the last token's chunk rather than on an empty one
    assert [c["choices"][0]["finish_reason"] for c in chunks[-2:]] == [None, "stop"]
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 50


def test_n_choices_and_max_tokens(client: httpx.Client) -> None:
    reply = client.post("/chat/completions", json=chat("a b", n=3)).json()
    assert [c["message"]["content"] for c in reply["choices"]] == [f"echo: a b [{i}]" for i in range(3)]
    assert reply["usage"]["completion_tokens"] == 12
    cut = client.post("/chat/completions", json=chat("#long 10", max_tokens=4)).json()["choices"][0]
    assert (cut["message"]["content"], cut["finish_reason"]) == ("w0 w1 w2 w3", "length")
    events = sse_events(client.post("/chat/completions", json=chat("x", n=2, stream=True)).text)
    text = {0: "", 1: ""}
    for event in events:
        choice = event["choices"][0]
        text[choice["index"]] += choice["delta"].get("content", "")
    assert text == {0: "echo: x [0]", 1: "echo: x [1]"}


def test_logprobs_and_token_ids_follow_the_word_tokenizer(client: httpx.Client) -> None:
    body = chat("one two three four five six", logprobs=True, top_logprobs=3, return_token_ids=True)
    choice = client.post("/chat/completions", json=body).json()["choices"][0]
    words = ["echo:", "one", "two", "three", "four", "five", "six"]
    assert choice["token_ids"] == [tid(w) for w in words]
    logprobs = choice["logprobs"]
    assert "refusal" not in logprobs  # vLLM omits it
    entries = logprobs["content"]
    assert [e["token"] for e in entries] == [w if i == 0 else " " + w for i, w in enumerate(words)]
    assert [e["logprob"] for e in entries] == pytest.approx([-0.1 * (i % 5) for i in range(len(words))])
    assert all(bytes(e["bytes"]).decode() == e["token"] for e in entries)
    assert all(len(e["top_logprobs"]) == 3 and e["top_logprobs"][0]["token"] == e["token"] for e in entries)
    streamed = sse_events(client.post("/chat/completions", json={**body, "stream": True}).text)
    stream_entries = [e for c in streamed[1:] for e in c["choices"][0]["logprobs"]["content"]]
    assert stream_entries == entries


def test_conformant_mode_has_no_vllm_fields(conformant: ScriptedUpstream) -> None:
    with httpx.Client(base_url=conformant.url) as http:
        reply = http.post("/chat/completions", json=chat("hi", logprobs=True, return_token_ids=True)).json()
        choice = reply["choices"][0]
        assert set(choice) == {"index", "message", "logprobs", "finish_reason"}
        assert set(choice["message"]) == {"role", "content", "refusal"}
        assert choice["logprobs"]["refusal"] is None
        assert "prompt_token_ids" not in reply
        assert "prompt_tokens_details" not in reply["usage"]
        events = sse_events(http.post("/chat/completions", json=chat("hi", stream=True)).text)
        assert events[-1]["choices"][0] == {
            "index": 0,
            "delta": {},
            "logprobs": None,
            "finish_reason": "stop",
        }
        error = http.post("/chat/completions", json=chat("#error 429"))
        assert error.json()["error"]["code"] == "rate_limit_exceeded"


@pytest.mark.parametrize("status", [500, 429, 503])
def test_scripted_errors(client: httpx.Client, status: int) -> None:
    response = client.post("/chat/completions", json=chat(f"#error {status}"))
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert (response.headers.get("retry-after") is not None) == (status == 429)


def test_garbage_and_bad_requests(client: httpx.Client) -> None:
    garbage = client.post("/chat/completions", json=chat("#garbage"))
    assert garbage.status_code == 200
    with pytest.raises(json.JSONDecodeError):
        garbage.json()
    garbage_stream = client.post("/chat/completions", json=chat("#garbage", stream=True)).text
    with pytest.raises(json.JSONDecodeError):
        sse_events(garbage_stream)
    assert client.post("/chat/completions", json={"model": "scripted-1"}).status_code == 400
    assert client.post("/chat/completions", content=b"{nope").status_code == 400
    assert client.post("/chat/completions", json=chat("x", n=0)).status_code == 400


def test_slow_delays_the_answer_and_every_stream_chunk(client: httpx.Client) -> None:
    started = time.perf_counter()
    client.post("/chat/completions", json=chat("#slow 150"))
    assert time.perf_counter() - started >= 0.15
    arrivals = []
    started = time.perf_counter()
    # Delays long against scheduling jitter on a loaded machine: the role chunk is not delayed, every later one is.
    with client.stream("POST", "/chat/completions", json=chat("#slow 300 #long 3", stream=True)) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.perf_counter() - started)
    assert len(arrivals) == 5  # role, three words, [DONE]
    assert arrivals[0] < 0.25
    assert all(later - earlier >= 0.2 for earlier, later in itertools.pairwise(arrivals))


def test_hang_never_answers_and_the_disconnect_is_recorded(upstream: ScriptedUpstream) -> None:
    before = len(upstream.requests)
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=upstream.url, timeout=0.3) as http:
        http.post("/chat/completions", json=chat("#hang"))
    record = upstream.wait_for_requests(before + 1)[before]
    deadline = time.monotonic() + 2
    while record.outcome == "in_progress" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert record.outcome == "disconnected"


def test_many_chunk_stream_is_not_delayed_by_nagle(client: httpx.Client) -> None:
    """Small writes with Nagle on stall ~40 ms behind delayed ACKs; the benchmark needs ~0.2 ms answers."""
    durations = []
    for _ in range(20):
        started = time.perf_counter()
        client.post("/chat/completions", json=chat("#long 40", stream=True)).raise_for_status()
        durations.append(time.perf_counter() - started)
    assert statistics.median(durations) < 0.02


def test_runs_as_a_standalone_process() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.support.scripted_upstream", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise
                time.sleep(0.05)
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat("ping")).json()
        assert reply["choices"][0]["message"]["content"] == "echo: ping"
    finally:
        process.terminate()
        process.wait(timeout=10)
