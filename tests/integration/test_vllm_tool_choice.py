"""Forced tool choice on the real vLLM engine with the embedded model: a named or `required` choice comes back
as real `tool_calls` whose arguments validate against the tool's JSON schema, streamed or not; `auto` keeps
answering in text when the model does not call a tool."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import VLLMServer
from tests.support.openai_schema import validate

pytestmark = pytest.mark.vllm

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
# Questions whose natural answer is *not* the forced tool, so only the constraint can make the call.
QUESTIONS = ["What is the weather in Paris?", "What is 2 plus 3?"]
CHOICES: list[Any] = [
    {"type": "function", "function": {"name": "get_weather"}},
    {"type": "function", "function": {"name": "add"}},
    "required",
]


def client(server: VLLMServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.gateway.url + "/v1", api_key="x", max_retries=0, timeout=300)


def _check_calls(calls: list[tuple[str, str]], choice: Any) -> None:
    assert calls, "no tool call came back"
    for name, arguments in calls:
        if isinstance(choice, dict):
            assert name == choice["function"]["name"]
        assert name in SCHEMAS
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("choice", CHOICES, ids=["named-weather", "named-add", "required"])
@pytest.mark.parametrize("question", QUESTIONS, ids=["weather", "sum"])
def test_forced_choice_returns_schema_valid_tool_calls(
    vllm_server: VLLMServer, choice: Any, question: str
) -> None:
    raw = client(vllm_server).chat.completions.with_raw_response.create(
        model=vllm_server.model,
        messages=[{"role": "user", "content": question}],
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice=choice,
        temperature=1.0,
        seed=7,
        max_tokens=256,
    )
    body = raw.http_response.json()
    validate("CreateChatCompletionResponse", body)
    [reply] = body["choices"]
    assert reply["finish_reason"] in {"stop", "tool_calls"}, reply
    assert not reply["message"]["content"], reply
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in reply["message"]["tool_calls"]]
    _check_calls(calls, choice)


@pytest.mark.parametrize("choice", CHOICES, ids=["named-weather", "named-add", "required"])
def test_forced_choice_streams_schema_valid_tool_calls(vllm_server: VLLMServer, choice: Any) -> None:
    stream = client(vllm_server).chat.completions.create(
        model=vllm_server.model,
        messages=[{"role": "user", "content": QUESTIONS[0]}],
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice=choice,
        temperature=1.0,
        seed=11,
        max_tokens=256,
        stream=True,
    )
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    content, finish = "", None
    for chunk in stream:
        validate("CreateChatCompletionStreamResponse", chunk.model_dump(exclude_unset=True))
        for part in chunk.choices:
            content += part.delta.content or ""
            finish = part.finish_reason or finish
            for call in part.delta.tool_calls or []:
                if call.function and call.function.name:
                    names[call.index] = call.function.name
                if call.function and call.function.arguments:
                    arguments[call.index] = arguments.get(call.index, "") + call.function.arguments
    assert finish in {"stop", "tool_calls"}
    assert not content.strip()
    _check_calls([(names[i], arguments.get(i, "")) for i in sorted(names)], choice)


def test_auto_still_answers_in_text(vllm_server: VLLMServer) -> None:
    reply = client(vllm_server).chat.completions.create(
        model=vllm_server.model,
        messages=[{"role": "user", "content": QUESTIONS[1]}],
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="auto",
        temperature=0,
        max_tokens=48,
    )
    message = reply.choices[0].message
    assert message.content and not message.tool_calls
    assert reply.choices[0].finish_reason in {"stop", "length"}


def test_allowed_tools_narrow_the_choice(vllm_server: VLLMServer) -> None:
    """vLLM has no `allowed_tools`: the gateway sends the allowed tools alone under the choice's mode."""
    choice = {
        "type": "allowed_tools",
        "allowed_tools": {"mode": "required", "tools": [{"type": "function", "function": {"name": "add"}}]},
    }
    reply = client(vllm_server).chat.completions.create(
        model=vllm_server.model,
        messages=[{"role": "user", "content": QUESTIONS[0]}],
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice=choice,  # type: ignore[arg-type]
        temperature=1.0,
        seed=5,
        max_tokens=256,
    )
    calls = [(c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls or []]  # type: ignore[union-attr]
    _check_calls(calls, {"function": {"name": "add"}})


def test_custom_tools_get_the_engines_refusal_in_openai_shape(vllm_server: VLLMServer) -> None:
    custom = {"type": "custom", "custom": {"name": "run_sql", "format": {"type": "text"}}}
    response = httpx.post(
        vllm_server.gateway.url + "/v1/chat/completions",
        json={"model": vllm_server.model, "messages": [{"role": "user", "content": "hi"}], "tools": [custom]},
        timeout=120,
    )
    assert response.status_code == 400, response.text
    validate("ErrorResponse", response.json())
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
