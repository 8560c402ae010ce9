"""The client matrix: the SDKs apps call the gateway with, one case per thing an app does with each.

A case runs a client against a `Target` (the gateway in front of the scripted upstream, or of vLLM with the
embedded model) and returns how many model calls it made; the test then checks what was captured. Tool loops
leave the choice to the model (`auto`) on the scripted upstream; the embedded 135M model does not pick tools
under `auto`, so on vLLM the same loops force the first call (`Target.forced`).

Adding a client or a case is one entry in `CASES`. A case names the API its client speaks (`api`: `chat` for
chat completions, `responses` for the Responses API); the target it runs against carries it, so a client that
speaks both (the AI SDK, the Agents SDK) runs the same case code on either.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import openai
from pydantic import BaseModel

NODE_DIR = Path(__file__).resolve().parent / "node"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": WEATHER_SCHEMA,
    },
}
RESPONSES_WEATHER_TOOL = {  # the same tool in the Responses API's flat shape
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": WEATHER_SCHEMA,
    "strict": True,
}
QUESTION = "What is the weather in Paris?"
# Budgets that keep the CPU engine quick; the scripted upstream ignores them.
MAX_TOKENS = 48
# For a reply that must be a whole JSON object (structured outputs, a forced tool call's arguments): sampling at
# vLLM's default temperature 1, the embedded model pads the JSON with whitespace or writes a long string value, and
# now and then runs past any budget (seen: 1 in 4 LangChain json_schema calls on the Responses API at 48 tokens;
# 1 to 2 in 300 forced calls at 64 or 128). The client cannot parse what was cut short, and vLLM returns a forced
# call cut short as text, with no tool call at all. So these calls are also greedy on vLLM
# (`Target.json_temperature`): a reply that fits once fits every time, through the same gateway path.
JSON_MAX_TOKENS = 128


@dataclass(frozen=True)
class Target:
    """Where a case sends its calls."""

    engine: str  # "scripted" or "vllm"
    base_url: str  # ends in /v1
    model: str
    api: str = "chat"  # the API of the case being run: "chat" or "responses"

    @property
    def json_temperature(self) -> float | None:
        """The temperature of a call whose reply must be a whole JSON object: greedy on vLLM (see
        `JSON_MAX_TOKENS`); None, the client's default, on the scripted upstream, which does not sample."""
        return 0.0 if self.engine == "vllm" else None

    @property
    def forced(self) -> bool:
        """The engine's model does not call tools on its own: loops force their first call."""
        return self.engine == "vllm"

    def ask(self, text: str, directive: str = "") -> str:
        """A user message; the scripted upstream reads its directives from it (`#tool`)."""
        return f"{text} {directive}" if self.engine == "scripted" and directive else text

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key="sk-matrix", max_retries=0, timeout=300)

    def async_openai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key="sk-matrix", max_retries=0, timeout=300)


@dataclass(frozen=True)
class Case:
    client: str
    name: str
    run: Callable[[Target], int]  # the number of model calls made (0: none should be captured)
    vllm: bool = True  # also run against vLLM with the embedded model
    api: str = "chat"  # the OpenAI API the client speaks to the gateway

    @property
    def id(self) -> str:
        return f"{self.client}: {self.name}"


class Weather(BaseModel):
    city: str
    sunny: bool


def _check_weather_call(name: str, arguments: Any) -> None:
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments) if isinstance(arguments, str) else arguments, WEATHER_SCHEMA)


# ----------------------------------------------------------------------------- openai-python
def openai_sync(target: Target) -> int:
    reply = target.openai().chat.completions.create(
        model=target.model, messages=[{"role": "user", "content": QUESTION}], max_tokens=MAX_TOKENS
    )
    assert reply.choices[0].message.content
    return 1


def openai_async(target: Target) -> int:
    """A two-turn conversation with the async client: the reply is appended, then the next question."""

    async def converse() -> None:
        client = target.async_openai()
        messages: list[Any] = [{"role": "user", "content": QUESTION}]
        first = await client.chat.completions.create(
            model=target.model, messages=messages, max_tokens=MAX_TOKENS
        )
        messages += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "And tomorrow?"},
        ]
        second = await client.chat.completions.create(
            model=target.model, messages=messages, max_tokens=MAX_TOKENS
        )
        assert second.choices[0].message.content is not None
        await client.close()

    asyncio.run(converse())
    return 2


def openai_stream(target: Target) -> int:
    text, usage = "", None
    for chunk in target.openai().chat.completions.create(
        model=target.model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    ):
        text += "".join(c.delta.content or "" for c in chunk.choices)
        usage = chunk.usage or usage
    assert text and usage is not None and usage.completion_tokens > 0
    return 1


def openai_tools(target: Target) -> int:
    """A forced tool call, then the tool's result sent back: one conversation."""
    client = target.openai()
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(
        model=target.model,
        messages=messages,
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=JSON_MAX_TOKENS,
        temperature=target.json_temperature,
    )
    message = first.choices[0].message
    [call] = message.tool_calls or []
    _check_weather_call(call.function.name, call.function.arguments)  # type: ignore[union-attr]
    messages += [
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'},
    ]
    second = client.chat.completions.create(model=target.model, messages=messages, max_tokens=MAX_TOKENS)
    assert second.choices[0].message.content
    return 2


def openai_parse(target: Target) -> int:
    reply = target.openai().chat.completions.parse(
        model=target.model,
        messages=[{"role": "user", "content": QUESTION}],
        response_format=Weather,
        max_tokens=JSON_MAX_TOKENS,
        temperature=target.json_temperature,
    )
    assert isinstance(reply.choices[0].message.parsed, Weather)
    return 1


# ----------------------------------------------------------------------------- openai-python, client.responses
def responses_create(target: Target) -> int:
    reply = target.openai().responses.create(
        model=target.model, instructions="Answer briefly.", input=QUESTION, max_output_tokens=MAX_TOKENS
    )
    assert reply.output_text and reply.status in {"completed", "incomplete"}
    return 1


def responses_stream(target: Target) -> int:
    """The SDK's stream helper: the text deltas add up to the response of the last event. That event is
    `response.incomplete` when the reply reaches `max_output_tokens` (the helper's `get_final_response` only
    takes `response.completed`, with OpenAI as here)."""
    deltas: list[str] = []
    final = None
    with target.openai().responses.stream(
        model=target.model, input=QUESTION, max_output_tokens=MAX_TOKENS
    ) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            elif event.type in ("response.completed", "response.incomplete"):
                final = event.response
    assert final is not None and deltas and "".join(deltas) == final.output_text
    assert final.usage is not None and final.usage.output_tokens > 0
    return 1


def responses_tool_loop(target: Target) -> int:
    """A function call, then its output sent as the next response of the chain (`previous_response_id`)."""
    client = target.openai()
    first = client.responses.create(
        model=target.model,
        input=target.ask(QUESTION, "#tool"),
        tools=[RESPONSES_WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"} if target.forced else "auto",
        max_output_tokens=JSON_MAX_TOKENS,
        temperature=target.json_temperature,
    )
    [call] = [item for item in first.output if item.type == "function_call"]
    _check_weather_call(call.name, call.arguments)
    second = client.responses.create(
        model=target.model,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}],
        max_output_tokens=MAX_TOKENS,
    )
    assert second.output_text and second.previous_response_id == first.id
    return 2


def responses_parse(target: Target) -> int:
    reply = target.openai().responses.parse(
        model=target.model,
        input=QUESTION,
        text_format=Weather,
        max_output_tokens=JSON_MAX_TOKENS,
        temperature=target.json_temperature,
    )
    assert isinstance(reply.output_parsed, Weather)
    return 1


# ----------------------------------------------------------------------------- openai-node and the AI SDK
def node(case: str, target: Target, **env: str) -> Any:
    """Run one case of tests/clients/node/cases.mjs; its JSON result. Its calls whose reply must be JSON use
    `MATRIX_JSON_TEMPERATURE` (empty: the client's default)."""
    json_temperature = target.json_temperature
    done = subprocess.run(
        ["node", str(NODE_DIR / "cases.mjs"), case, target.base_url, target.model],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=NODE_DIR,
        env={
            **os.environ,
            "MATRIX_API": target.api,
            "MATRIX_JSON_TEMPERATURE": "" if json_temperature is None else str(json_temperature),
            **env,
        },
        check=False,
    )
    assert done.returncode == 0, f"{case} failed:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def node_stream(target: Target) -> int:
    result = node("openai-node stream", target)
    assert result["text"] and result["finish"] in {"stop", "length"} and result["completionTokens"] > 0
    return 1


def node_tools(target: Target) -> int:
    result = node("openai-node tools", target)
    [call] = result["calls"]
    _check_weather_call(call["name"], call["arguments"])
    assert result["text"]
    return 2


def node_responses_stream(target: Target) -> int:
    result = node("openai-node responses stream", target)
    assert result["text"] and result["text"] == result["outputText"]
    assert result["status"] in {"completed", "incomplete"} and result["outputTokens"] > 0
    return 1


def node_tool_loop(case: str, target: Target) -> Any:
    """A Node tool loop (its first call chosen under `auto`, or forced where the model would not choose it):
    one call of the weather tool, then a text answer."""
    result = node(
        case, target, MATRIX_PROMPT=target.ask(QUESTION, "#tool"), MATRIX_FORCED="1" if target.forced else "0"
    )
    [call] = result["calls"]
    _check_weather_call(call["name"], call["arguments"])
    assert result["text"]
    return result


def node_responses_tool(target: Target) -> int:
    node_tool_loop("openai-node responses tool", target)
    return 2


def node_errors(target: Target) -> int:
    result = node("openai-node errors", target)
    assert result["unknown model"] == {
        "cls": "NotFoundError",
        "status": 404,
        "type": "not_found_error",
        "code": "model_not_found",
        "param": "model",
    }
    assert result["bad request"]["cls"] == "BadRequestError" and result["bad request"]["status"] == 400
    assert (
        result["bad request"]["type"] == "invalid_request_error"
        and result["bad request"]["param"] == "messages"
    )
    return 0


def ai_sdk_tool_loop(target: Target) -> int:
    assert node_tool_loop("ai-sdk tool loop", target)["steps"] == 2
    return 2


def ai_sdk_stream_text(target: Target) -> int:
    result = node("ai-sdk streamText", target)
    assert result["text"] and result["finish"] in {"stop", "length"} and result["outputTokens"] > 0
    return 1


def ai_sdk_generate_object(target: Target) -> int:
    result = node("ai-sdk generateObject", target)
    jsonschema.validate(
        result["object"],
        {
            "type": "object",
            "properties": {"city": {"type": "string"}, "sunny": {"type": "boolean"}},
            "required": ["city", "sunny"],
        },
    )
    return 1


# ----------------------------------------------------------------------------- LangChain
def _chat_model(target: Target, *, json_reply: bool = False, **options: Any) -> Any:
    """`ChatOpenAI` speaking the case's API: `use_responses_api` for "responses" (as it turns on by itself for
    OpenAI's newer models and Responses-only options). `json_reply`: its replies must be whole JSON objects
    (`JSON_MAX_TOKENS`, `Target.json_temperature`)."""
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=target.model,
        base_url=target.base_url,
        api_key="sk-matrix",
        max_retries=0,
        max_tokens=JSON_MAX_TOKENS if json_reply else MAX_TOKENS,  # type: ignore[arg-type]
        temperature=target.json_temperature if json_reply else None,
        use_responses_api=target.api == "responses",
        **options,
    )


def _get_weather_tool() -> Any:
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return f"sunny in {city}"

    return get_weather


def langchain_invoke(target: Target) -> int:
    assert _chat_model(target).invoke(QUESTION).text
    return 1


def langchain_stream(target: Target) -> int:
    """The chunks' text adds up (on the Responses API their content is a list of text blocks)."""
    chunks = list(_chat_model(target).stream(QUESTION))
    text = "".join(chunk.text for chunk in chunks)
    assert text and text == sum(chunks[1:], chunks[0]).text
    return 1


def langchain_tool_loop(target: Target, **options: Any) -> int:
    """`bind_tools`: the model calls the tool, the app runs it and sends the result back (on the Responses API,
    the whole conversation, unless `use_previous_response_id` sends only what follows the last reply)."""
    from langchain_core.messages import HumanMessage, ToolMessage

    weather = _get_weather_tool()
    model = _chat_model(target, **options)
    first_model = _chat_model(target, json_reply=True, **options).bind_tools(
        [weather], tool_choice="get_weather" if target.forced else None
    )
    messages: list[Any] = [HumanMessage(target.ask(QUESTION, "#tool"))]
    reply = first_model.invoke(messages)
    [call] = reply.tool_calls
    _check_weather_call(call["name"], call["args"])
    messages += [reply, ToolMessage(weather.invoke(call["args"]), tool_call_id=call["id"])]
    final = model.bind_tools([weather], tool_choice="none" if target.forced else None).invoke(messages)
    assert final.text and not final.tool_calls
    if options.get("use_previous_response_id"):
        assert target.openai().responses.retrieve(final.id).previous_response_id == reply.id
    return 2


def langchain_tool_loop_chained(target: Target) -> int:
    return langchain_tool_loop(target, use_previous_response_id=True)


def _structured(method: str) -> Callable[[Target], int]:
    def run(target: Target) -> int:
        schema: Any = Weather if method != "json_mode" else {"title": "weather", "type": "object"}
        model = _chat_model(target, json_reply=True)
        result = model.with_structured_output(schema, method=method).invoke(QUESTION)  # type: ignore[arg-type]
        assert isinstance(result, Weather if method != "json_mode" else dict), result
        return 1

    run.__name__ = f"langchain_structured_{method}"
    return run


# ----------------------------------------------------------------------------- litellm and the Agents SDK
def _litellm() -> Any:
    """litellm, imported with its bundled cost map (it would otherwise fetch one from the internet)."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    return litellm


def _litellm_route(target: Target) -> dict[str, Any]:
    """What every litellm call names: the gateway as an OpenAI-compatible provider."""
    return {"model": f"openai/{target.model}", "api_base": target.base_url, "api_key": "sk-matrix"}


def litellm_completion(target: Target) -> int:
    reply = _litellm().completion(
        messages=[{"role": "user", "content": QUESTION}], max_tokens=MAX_TOKENS, **_litellm_route(target)
    )
    assert reply.choices[0].message.content
    return 1


def litellm_stream(target: Target) -> int:
    """`completion(stream=True)`: litellm's own chunk wrapper over the gateway's server-sent events, with the
    usage chunk it asks for."""
    text, usage = "", None
    for chunk in _litellm().completion(
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        **_litellm_route(target),
    ):
        text += "".join(c.delta.content or "" for c in chunk.choices)
        usage = getattr(chunk, "usage", None) or usage
    assert text and usage is not None and usage.completion_tokens > 0
    return 1


def litellm_responses_chain(target: Target) -> int:
    """`litellm.responses` for an `openai/` model goes to the gateway's `/v1/responses`; the second turn
    continues the first by `previous_response_id`."""
    litellm = _litellm()
    route = _litellm_route(target)
    first = litellm.responses(input=QUESTION, max_output_tokens=MAX_TOKENS, **route)
    second = litellm.responses(
        input="And tomorrow?", previous_response_id=first.id, max_output_tokens=MAX_TOKENS, **route
    )
    for reply in (first, second):
        texts = [c.text for item in reply.output if item.type == "message" for c in item.content]
        assert "".join(texts) and reply.status in {"completed", "incomplete"}
    # litellm hands out its own encoding of the gateway's id (provider and model folded in) and decodes it again
    # when sent back, so the gateway echoes its own id. The second input alone does not repeat the first turn:
    # the one episode the matrix checks for is made by the chain, not by stitching.
    assert second.previous_response_id is not None and second.previous_response_id != first.id
    return 2


def _run_agent(target: Target, *, chained: bool = False) -> int:
    """An agent with one tool: the tool call and the answer after it are one run. With `target.api` "chat" the
    agent's model is `OpenAIChatCompletionsModel`; with "responses" it is the SDK's default (its OpenAI provider
    serves every model through the Responses API). `chained`: the runner continues each turn by
    `previous_response_id` (`auto_previous_response_id`) instead of sending the whole input back.

    On vLLM the call is forced and the run ends on the tool's output (the model would not pick it)."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIProvider,
        RunConfig,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return f"sunny in {city}"

    model: Any
    if target.api == "chat":
        model = OpenAIChatCompletionsModel(model=target.model, openai_client=target.async_openai())
        config = RunConfig()
    else:  # a model by name, from the SDK's default provider: OpenAI's, which serves it by the Responses API
        model = target.model
        config = RunConfig(model_provider=OpenAIProvider(openai_client=target.async_openai()))
    agent = Agent(
        name="weather",
        instructions="Answer weather questions with the get_weather tool.",
        model=model,
        tools=[get_weather],
        # Forced, one call: `required` alone lets vLLM's structured outputs generate several (up to the limit).
        model_settings=ModelSettings(
            max_tokens=JSON_MAX_TOKENS,
            temperature=target.json_temperature,
            tool_choice="required" if target.forced else None,
            parallel_tool_calls=False if target.forced else None,
        ),
        tool_use_behavior="stop_on_first_tool" if target.forced else "run_llm_again",
    )
    result = Runner.run_sync(
        agent,
        target.ask(QUESTION, "#tool"),
        max_turns=4,
        run_config=config,
        auto_previous_response_id=chained,
    )
    assert result.final_output
    calls = [item for item in result.new_items if item.type == "tool_call_item"]
    assert len(calls) == 1, [r.output for r in result.raw_responses]  # what the model answered
    made = 1 if target.forced else 2
    assert len(result.raw_responses) == made
    if chained:
        first, second = (r.response_id for r in result.raw_responses)
        assert first is not None and second is not None
        assert target.openai().responses.retrieve(second).previous_response_id == first
    return made


def agents_one_tool(target: Target) -> int:
    return _run_agent(target)


def agents_chained(target: Target) -> int:
    return _run_agent(target, chained=True)


CASES: list[Case] = [
    Case("openai-python", "sync", openai_sync),
    Case("openai-python", "async two-turn", openai_async),
    Case("openai-python", "stream", openai_stream),
    Case("openai-python", "forced tool loop", openai_tools),
    Case("openai-python", "parse", openai_parse),
    Case("openai-node", "stream", node_stream),
    Case("openai-node", "forced tool loop", node_tools),
    Case("openai-node", "errors", node_errors, vllm=False),
    Case("langchain", "invoke", langchain_invoke),
    Case("langchain", "stream", langchain_stream),
    Case("langchain", "bind_tools loop", langchain_tool_loop),
    Case("langchain", "structured function_calling", _structured("function_calling")),
    Case("langchain", "structured json_schema", _structured("json_schema")),
    # JSON mode constrains to *some* JSON object; the 135M model does not reliably close one within a budget.
    Case("langchain", "structured json_mode", _structured("json_mode"), vllm=False),
    Case("litellm", "completion", litellm_completion),
    Case("litellm", "completion stream", litellm_stream),
    Case("ai-sdk", "chat tool loop", ai_sdk_tool_loop),
    Case("ai-sdk", "chat generateObject", ai_sdk_generate_object),
    Case("openai-agents", "chat-completions one-tool agent", agents_one_tool),
    # The Responses API (`/v1/responses`).
    Case("openai-python", "responses create", responses_create, api="responses"),
    Case("openai-python", "responses stream", responses_stream, api="responses"),
    Case(
        "openai-python", "responses tool loop by previous_response_id", responses_tool_loop, api="responses"
    ),
    Case("openai-python", "responses parse", responses_parse, api="responses"),
    Case("openai-node", "responses stream", node_responses_stream, api="responses"),
    Case("openai-node", "responses tool loop, whole input sent back", node_responses_tool, api="responses"),
    Case("ai-sdk", "responses tool loop", ai_sdk_tool_loop, api="responses"),
    Case("ai-sdk", "responses streamText", ai_sdk_stream_text, api="responses"),
    Case("ai-sdk", "responses generateObject", ai_sdk_generate_object, api="responses"),
    Case("langchain", "responses invoke", langchain_invoke, api="responses"),
    Case("langchain", "responses stream", langchain_stream, api="responses"),
    Case(
        "langchain", "responses bind_tools loop, whole input sent back", langchain_tool_loop, api="responses"
    ),
    Case(
        "langchain",
        "responses bind_tools loop, use_previous_response_id",
        langchain_tool_loop_chained,
        api="responses",
    ),
    Case(
        "langchain", "responses structured function_calling", _structured("function_calling"), api="responses"
    ),
    Case("langchain", "responses structured json_schema", _structured("json_schema"), api="responses"),
    Case(
        "langchain", "responses structured json_mode", _structured("json_mode"), vllm=False, api="responses"
    ),
    Case(
        "litellm", "responses, second turn by previous_response_id", litellm_responses_chain, api="responses"
    ),
    Case("openai-agents", "responses one-tool agent", agents_one_tool, api="responses"),
    # Chaining needs a second model turn after the tool; on vLLM the forced run ends on the tool's output.
    Case(
        "openai-agents",
        "responses agent, auto_previous_response_id",
        agents_chained,
        vllm=False,
        api="responses",
    ),
]
