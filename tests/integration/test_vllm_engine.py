"""The gateway on the real vLLM engine (CPU build) with the embedded model: capture of token ids and behaviour
logprobs, LoRA versions addressed by name, tools, and recovery from an engine crash."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from gateway.policies import create_policy_with_initial_adapter
from storage.database import Database
from storage.policies import activate_version, adapter_dir, add_adapter, get_policy
from tests.conftest import VLLMServer, query
from tests.support.openai_schema import validate

pytestmark = pytest.mark.vllm

PROMPT = [{"role": "user", "content": "Name three colours of the rainbow."}]


def client(server: VLLMServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.gateway.url + "/v1", api_key="x", max_retries=0, timeout=120)


def stored(server: VLLMServer, request_id: str) -> dict[str, Any]:
    server.gateway.flush()
    [row] = query(server.gateway.settings.database_url, "SELECT * FROM calls WHERE id = :id", id=request_id)
    for key in ("response", "completion_token_ids", "completion_logprobs", "prompt_token_ids", "usage"):
        if isinstance(row[key], str):
            row[key] = json.loads(row[key])
    return row


def greedy(server: VLLMServer, model: str, max_tokens: int = 24) -> str:
    reply = client(server).chat.completions.create(
        model=model, messages=PROMPT, temperature=0, max_tokens=max_tokens
    )
    return reply.choices[0].message.content or ""


def run(server: VLLMServer, coro: Any) -> Any:
    async def wrapped() -> Any:
        database = Database(server.gateway.settings.database_url)
        try:
            return await coro(database)
        finally:
            await database.dispose()

    return asyncio.run(wrapped())


def wait_until_served(server: VLLMServer, model: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if model in {m.id for m in client(server).models.list().data}:
            return
        time.sleep(0.2)
    raise TimeoutError(f"{model} never appeared in /v1/models")


def test_non_stream_captures_token_ids_and_processed_logprobs(
    vllm_server: VLLMServer, embedded_model: Path
) -> None:
    from transformers import AutoTokenizer

    raw = client(vllm_server).chat.completions.with_raw_response.create(
        model=vllm_server.model, messages=PROMPT, temperature=0.7, top_p=0.9, max_tokens=24, seed=3
    )
    body = raw.http_response.json()
    validate("CreateChatCompletionResponse", body)
    assert "token_ids" not in body["choices"][0] and "prompt_token_ids" not in body
    assert body["choices"][0]["logprobs"] is None
    text = body["choices"][0]["message"]["content"]

    row = stored(vllm_server, raw.headers["x-request-id"])
    ids, logprobs = row["completion_token_ids"][0], row["completion_logprobs"][0]
    assert len(ids) == len(logprobs) == body["usage"]["completion_tokens"]
    assert all(lp <= 0.0 for lp in logprobs)
    tokenizer = AutoTokenizer.from_pretrained(embedded_model)
    assert tokenizer.decode(ids, skip_special_tokens=True).strip() == text.strip()
    assert len(row["prompt_token_ids"]) == body["usage"]["prompt_tokens"]
    assert tokenizer.decode(row["prompt_token_ids"]).count("Name three colours") == 1


def test_stream_captures_the_same(vllm_server: VLLMServer) -> None:
    raw = client(vllm_server).chat.completions.with_raw_response.create(
        model=vllm_server.model,
        messages=PROMPT,
        temperature=0,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in raw.parse():
        validate("CreateChatCompletionStreamResponse", chunk.model_dump(exclude_unset=True))
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    row = stored(vllm_server, raw.headers["x-request-id"])
    assert row["status"] == "ok"
    assert row["response"]["choices"][0]["message"]["content"] == text
    assert usage is not None
    assert (
        len(row["completion_token_ids"][0]) == len(row["completion_logprobs"][0]) == usage.completion_tokens
    )
    assert text == greedy(vllm_server, vllm_server.model, max_tokens=16)  # stream and non-stream agree


def test_client_logprobs_when_asked(vllm_server: VLLMServer) -> None:
    reply = client(vllm_server).chat.completions.create(
        model=vllm_server.model, messages=PROMPT, max_tokens=5, logprobs=True, top_logprobs=2
    )
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    assert len(content) == reply.usage.completion_tokens  # type: ignore[union-attr]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_call(vllm_server: VLLMServer, stream: bool) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs: dict[str, Any] = {
        "model": vllm_server.model,
        "messages": messages,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 64,
        "temperature": 0,
    }
    if stream:
        names, arguments = set(), ""
        for chunk in client(vllm_server).chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                for call in choice.delta.tool_calls or []:
                    if call.function and call.function.name:
                        names.add(call.function.name)
                    arguments += (call.function.arguments or "") if call.function else ""
        assert names == {"get_weather"}
        assert isinstance(json.loads(arguments), dict)
    else:
        reply = client(vllm_server).chat.completions.create(**kwargs)
        [call] = reply.choices[0].message.tool_calls or []
        assert call.function.name == "get_weather"  # type: ignore[union-attr]
        assert isinstance(json.loads(call.function.arguments), dict)  # type: ignore[union-attr]
    auto = client(vllm_server).chat.completions.create(**{**kwargs, "tool_choice": "auto"})
    assert auto.choices[0].finish_reason in {"stop", "length", "tool_calls"}


def _write_random_adapter(source: Path, target: Path, seed: int) -> None:
    """A real PEFT adapter with non-zero B, so it changes the model's output."""
    from safetensors.torch import load_file, save_file

    target.mkdir(parents=True)
    weights = load_file(source / "adapter_model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in weights.items():
        if "lora_B" in name:
            weights[name] = (torch.randn(tensor.shape, generator=generator) * 0.05).to(tensor.dtype)
    save_file(weights, target / "adapter_model.safetensors")
    (target / "adapter_config.json").write_text((source / "adapter_config.json").read_text())


def test_policy_versions_are_served_by_name(vllm_server: VLLMServer) -> None:
    data = vllm_server.data_dir

    async def create(database: Database) -> None:
        await create_policy_with_initial_adapter(database, data, "bot", vllm_server.model, actor="tests")

    run(vllm_server, create)
    wait_until_served(vllm_server, "bot")
    base = greedy(vllm_server, vllm_server.model)
    # A zero-initialised adapter reproduces the base model's greedy output exactly.
    assert greedy(vllm_server, "bot") == base
    assert greedy(vllm_server, "bot@0") == base

    v0 = adapter_dir(data, "bot", 0)
    for version in (1, 2):
        _write_random_adapter(v0, adapter_dir(data, "bot", version), seed=version)

    async def register(database: Database) -> None:
        async with database.session() as session:
            policy = await get_policy(session, "bot")
            assert policy is not None
            for version in (1, 2):
                await add_adapter(
                    session, policy.id, version, str(adapter_dir(data, "bot", version)), parent_version=0
                )
            await session.commit()

    run(vllm_server, register)
    deadline = time.monotonic() + 60  # the router re-reads policies every 0.5 s; allow for a loaded machine
    while (
        httpx.post(
            vllm_server.gateway.url + "/v1/chat/completions",
            json={"model": "bot@2", "messages": PROMPT, "max_tokens": 1},
            timeout=120,
        ).status_code
        == 404
    ):
        assert time.monotonic() < deadline, "versions 1 and 2 never became addressable"
        time.sleep(0.3)
    one, two = greedy(vllm_server, "bot@1"), greedy(vllm_server, "bot@2")
    assert len({base, one, two}) == 3
    assert greedy(vllm_server, "bot") == base  # still version 0 until promoted

    async def promote(database: Database) -> None:
        async with database.session() as session:
            policy = await get_policy(session, "bot")
            assert policy is not None
            await activate_version(session, policy.id, 2)
            await session.commit()

    run(vllm_server, promote)
    deadline = time.monotonic() + 10
    while greedy(vllm_server, "bot") != two and time.monotonic() < deadline:
        time.sleep(0.3)
    assert greedy(vllm_server, "bot") == two

    raw = client(vllm_server).chat.completions.with_raw_response.create(
        model="bot@1", messages=PROMPT, max_tokens=4
    )
    row = stored(vllm_server, raw.headers["x-request-id"])
    assert (row["policy"], row["adapter_version"], row["engine_model"]) == ("bot", 1, "bot@1")
    assert raw.headers["x-kaizen-model"] == "bot@1"

    missing = httpx.post(
        vllm_server.gateway.url + "/v1/chat/completions", json={"model": "bot@9", "messages": PROMPT}
    )
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"
    assert "bot" in {m.id for m in client(vllm_server).models.list().data}


@pytest.mark.parametrize(
    ("route", "extra", "refused"),
    [
        ("/v1/completions", {"prompt": "The colours of the rainbow are", "echo": True}, None),
        (
            "/v1/completions",
            {"prompt": ["The colours of", "the rainbow"], "echo": True, "logprobs": 1},
            "echo",
        ),
        (
            "/v1/completions",
            {"prompt": "The colours of the rainbow", "prompt_logprobs": 1},
            "prompt_logprobs",
        ),
        ("/v1/chat/completions", {"messages": PROMPT, "prompt_logprobs": 0}, "prompt_logprobs"),
        ("/v1/chat/completions", {"messages": PROMPT, "echo": True}, "echo"),
    ],
    ids=["echo", "echo with logprobs", "completion prompt_logprobs", "chat prompt_logprobs", "chat echo"],
)
def test_prompt_logprobs_never_reach_the_engine(
    vllm_server: VLLMServer, route: str, extra: dict[str, Any], refused: str | None
) -> None:
    # vLLM with LoRA enabled (always, here) crashes its engine core computing logprobs of a prompt of more than
    # one token: one such request would take the engine down for every client until it restarts.
    engine = vllm_server.gateway.services.engine
    restarts = engine.restarts
    answer = httpx.post(
        vllm_server.gateway.url + route,
        json={"model": vllm_server.model, "max_tokens": 2, **extra},
        timeout=120,
    )
    if refused is None:
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"].startswith(extra["prompt"])
        # Captured, without the token ids and behaviour logprobs that would cost the echo or the engine.
        row = stored(vllm_server, answer.headers["x-request-id"])
        assert (row["status"], row["completion_token_ids"]) == ("ok", None), row
    else:
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert (error["param"], error["code"]) == (refused, "unsupported_parameter"), error
    assert greedy(vllm_server, vllm_server.model, max_tokens=2)
    assert engine.restarts == restarts


def test_engine_crash_gives_clean_errors_then_recovers(vllm_server: VLLMServer) -> None:
    engine = vllm_server.gateway.services.engine
    process = engine._process  # type: ignore[attr-defined]
    assert process is not None
    process.kill()
    statuses: list[int] = []
    recovered = False
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        response = httpx.post(
            vllm_server.gateway.url + "/v1/chat/completions",
            json={"model": vllm_server.model, "messages": PROMPT, "max_tokens": 4},
            timeout=60,
        )
        statuses.append(response.status_code)
        if response.status_code == 200:
            recovered = True
            break
        assert response.status_code == 503, response.text
        assert "retry-after" in response.headers
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        time.sleep(1)
    assert recovered, statuses
    assert 503 in statuses
    assert engine.restarts >= 1  # type: ignore[attr-defined]
    with pytest.raises(ProcessLookupError):  # the dead server's engine core and workers were stopped too
        os.killpg(process.pid, 0)
    # Adapters loaded before the crash are served again.
    assert greedy(vllm_server, "bot@2", max_tokens=4)
    rows = query(vllm_server.gateway.settings.database_url, "SELECT status FROM calls WHERE status = 'error'")
    assert len(rows) >= 1  # the failed calls were captured too
