"""A fast, deterministic OpenAI-compatible upstream for integration tests and the overhead benchmark.

The reply is scripted by directives in the last user message, so a test states the upstream's
behaviour in the request itself and needs no mocks:

- no directive: content ``"echo: <last user text>"``, finish_reason ``stop``;
- ``#tool`` / ``#tools2``: one / two parallel ``get_weather`` tool calls, finish_reason ``tool_calls``;
- ``#json TEXT``: the content is TEXT (words joined by single spaces), e.g. a JSON object for structured output;
- ``#refuse``: no content but a ``refusal`` (streamed as refusal deltas), as OpenAI's models refuse;
- ``#think``: the text answer comes after a reasoning text (``THOUGHT``), as a reasoning parser returns it:
  ``reasoning`` in the message and in deltas before the content (vLLM), ``reasoning_content`` otherwise (DeepSeek);
- ``#agent N``: an agent loop of N turns: while fewer than N tool results follow the last user message, one
  ``get_weather`` call (a new city each turn); then the content ``"done: <the tool results>"``;
- ``#long N``: N words (``w0 w1 ...``) so streams have many chunks;
- ``#slow MS``: wait MS ms before answering (streams: before every chunk after the first);
- ``#error STATUS``: that HTTP status with an error body;
- ``#garbage``: status 200 with a body that is not valid JSON (or SSE);
- ``#hang``: never answers.

A tool result after the last user message stands in for it, so a tool loop ends with ``"echo: <result>"``.
Clients' own loops are answered as a model would: a named (or ``required``) ``tool_choice`` gets a call of
that tool with arguments made from its JSON schema (so does ``#tool`` when the request's tools have no
``get_weather``), a request whose last message is a tool result gets a text answer, and a ``response_format``
gets JSON content (an instance of its schema, or ``{"echo": ...}`` for ``json_object``).

``/v1/completions`` answers ``echo: <prompt>`` the same way (per-choice ``token_ids``, ``prompt_token_ids``
and ``token_logprobs`` as vLLM lays them out) and ``/v1/embeddings`` deterministic 8-dimensional vectors.

Like vLLM started with ``--enable-lora``, it takes runtime adapters (``/v1/load_lora_adapter``,
``/v1/unload_lora_adapter``, refusing a name loaded twice and a path that is not a directory) and lists them
under ``/v1/models``, so gateways can serve policy versions through it; replies do not depend on the adapter.

By default the server mimics vLLM's deviations from the OpenAI spec (``message.annotations: null``,
``message.function_call: null``, ``usage.prompt_tokens_details: null``, logprobs without
``refusal``, ``stop_reason``/``token_ids`` fields, finish_reason on the last token's chunk, integer
error codes) so the gateway's normaliser is exercised, and it serves vLLM's runtime LoRA API
(``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``), so a gateway attached to it with
``KAIZEN_ENGINE=vllm`` routes policy versions; ``vllm_quirks=False`` answers like OpenAI.

Tokens are whitespace-separated words: token ``i`` of a reply is the word (with its leading space
after the first), its id is ``crc32(word) % 50000`` and its logprob ``-(i % 5) / 10``.

Run standalone (the benchmark does): ``python -m tests.support.scripted_upstream --port P``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import logging
import re
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Literal

import msgspec
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from tests.support.background_server import BackgroundServer

logger = logging.getLogger(__name__)

MODELS: Final = ("scripted-1", "scripted-2")
VOCAB_SIZE: Final = 50_000
MAX_CHOICES: Final = 16
MAX_TOP_LOGPROBS: Final = 20

_DIRECTIVE = re.compile(r"#(tools2|tool|agent|long|slow|error|garbage|hang|refuse|think)\b(?:\s+(\d+))?")
_JSON_HEADERS: Final = {"Content-Type": "application/json"}
_SSE_HEADERS: Final = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_DONE: Final = b"data: [DONE]\n\n"
_TOOL_ARGUMENTS: Final = ('{"city": "Paris"}', '{"city": "London"}')
REFUSAL: Final = "I can't help with that."
THOUGHT: Final = "The user wants an echo, so I repeat the words."
_AGENT_CITIES: Final = ("Paris", "London", "Tokyo", "Lima", "Oslo", "Cairo")

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode

Outcome = Literal["in_progress", "completed", "disconnected"]


def token_id(word: str) -> int:
    """Stable id of one word, so tests can recompute the ids the upstream reports."""
    return zlib.crc32(word.encode()) % VOCAB_SIZE


def token_logprob(position: int) -> float:
    """Logprob of the token at ``position``; varied so a captured logprob can be traced to its token."""
    return -(position % 5) / 10


def text_token_ids(text: str) -> list[int]:
    """Token ids of a text under the word tokenizer (used for prompts and replies alike)."""
    return [token_id(word) for word in text.split()]


@dataclass(frozen=True, slots=True)
class Script:
    """What the last user message asks the upstream to do."""

    tool_calls: int = 0
    long_words: int | None = None
    slow_ms: int = 0
    error_status: int | None = None
    garbage: bool = False
    hang: bool = False
    json_text: str | None = None
    refuse: bool = False
    agent_turns: int = 0
    think: bool = False


@functools.lru_cache(maxsize=4096)
def parse_script(text: str) -> Script:
    """Read the directives out of a user message; cached because benchmarks repeat one message."""
    tool_calls, long_words, slow_ms, error_status, agent_turns = 0, None, 0, None, 0
    garbage = hang = refuse = think = False
    for name, arg in _DIRECTIVE.findall(text):
        number = int(arg) if arg else None
        if name == "tool":
            tool_calls = 1
        elif name == "tools2":
            tool_calls = 2
        elif name == "agent":
            agent_turns = number if number is not None else 1
        elif name == "long":
            long_words = number if number is not None else 100
        elif name == "slow":
            slow_ms = number or 0
        elif name == "error":
            error_status = number if number is not None and 400 <= number <= 599 else 500
        elif name == "garbage":
            garbage = True
        elif name == "refuse":
            refuse = True
        elif name == "think":
            think = True
        else:
            hang = True
    _, json_directive, json_text = text.partition("#json ")
    return Script(
        tool_calls,
        long_words,
        slow_ms,
        error_status,
        garbage,
        hang,
        json_text=json_text if json_directive else None,
        refuse=refuse,
        agent_turns=agent_turns,
        think=think,
    )


@dataclass(frozen=True, slots=True)
class Generation:
    """One choice's scripted output: the text the 'model' sampled, split into tokens."""

    pieces: tuple[str, ...]
    token_ids: tuple[int, ...]
    content: str | None
    tool_calls: tuple[tuple[str, str], ...]  # (function name, JSON arguments)
    finish_reason: str
    refusal: str | None = None  # the pieces are the refusal's, not content
    reasoning: str | None = None  # sent before the content (a scripted simplification: it has no tokens)


def _tokenise(words: Sequence[str]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    pieces = tuple(word if i == 0 else " " + word for i, word in enumerate(words))
    return pieces, tuple(token_id(word) for word in words)


@dataclass(frozen=True, slots=True)
class Plan:
    """What the request itself asks for beyond the directives: a forced or scripted call of one of its tools
    (name, JSON arguments), a JSON content (`response_format`), or a text answer to a tool result."""

    tool: tuple[str, str] | None = None
    json_content: str | None = None
    after_tool: bool = False


@functools.lru_cache(maxsize=4096)
def generate(
    last_user_text: str,
    choices: int,
    max_tokens: int | None,
    plan: Plan = Plan(),
    tool_results: tuple[str, ...] = (),
    agent_turns: int = 0,
) -> tuple[Generation, ...]:
    """Deterministic outputs for a request; cached so the hot path only builds JSON."""
    script = parse_script(last_user_text)
    outputs = []
    for index in range(choices):
        calls: tuple[tuple[str, str], ...] = ()
        if agent_turns > len(tool_results):
            city = _AGENT_CITIES[len(tool_results) % len(_AGENT_CITIES)]
            calls = (("get_weather", f'{{"city": "{city}"}}'),)
        elif not plan.after_tool and (plan.tool is not None or script.tool_calls):
            if plan.tool is not None:
                calls = (plan.tool,)
            else:
                calls = tuple(("get_weather", _TOOL_ARGUMENTS[k]) for k in range(script.tool_calls))
        if calls:
            raw = " ".join(
                f'<tool_call> {{"name": "{name}", "arguments": {args}}} </tool_call>' for name, args in calls
            )
            pieces, ids = _tokenise(raw.split())
            outputs.append(Generation(pieces, ids, None, calls, "tool_calls"))
            continue
        if script.refuse and not plan.after_tool:
            pieces, ids = _tokenise(REFUSAL.split())
            outputs.append(Generation(pieces, ids, None, (), "stop", refusal="".join(pieces)))
            continue
        if plan.json_content is not None and script.json_text is None:  # a `#json` directive wins
            pieces, ids = _tokenise(plan.json_content.split(" "))
            outputs.append(Generation(pieces, ids, plan.json_content, (), "stop"))
            continue
        if script.json_text is not None:
            words = script.json_text.split()
        elif script.long_words is not None and not plan.after_tool:
            words = [f"w{i}" for i in range(script.long_words)]
        elif agent_turns:
            words = ["done:", *" | ".join(tool_results).split()]
        else:
            words = ["echo:", *last_user_text.split()]
        if choices > 1:
            words.append(f"[{index}]")
        finish = "stop"
        if max_tokens is not None and len(words) > max_tokens:
            words, finish = words[:max_tokens], "length"
        pieces, ids = _tokenise(words)
        reasoning = THOUGHT if script.think and not plan.after_tool else None
        outputs.append(Generation(pieces, ids, "".join(pieces), (), finish, reasoning=reasoning))
    return tuple(outputs)


def _schema_object(schema: dict[str, Any], key: str) -> dict[str, Any]:
    """`schema[key]` where the schema must hold an object: a real engine cannot compile the schema otherwise."""
    value = schema.get(key) or {}
    if not isinstance(value, dict):
        raise BadRequest(f"invalid JSON schema: {key!r} must be an object")
    return value


def example_of(schema: Any, defs: dict[str, Any] | None = None) -> Any:
    """A small value valid under a JSON schema (the subset tools and response formats use)."""
    if not isinstance(schema, dict):
        return "x"
    defs = {**(defs or {}), **_schema_object(schema, "$defs"), **_schema_object(schema, "definitions")}
    if "$ref" in schema:
        return example_of(defs.get(str(schema["$ref"]).rsplit("/", 1)[-1]), defs)
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        if not isinstance(schema["enum"], list):
            raise BadRequest("invalid JSON schema: 'enum' must be an array")
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if not isinstance(schema.get(key, []), list):
            raise BadRequest(f"invalid JSON schema: {key!r} must be an array")
        options = [o for o in schema.get(key, []) if not (isinstance(o, dict) and o.get("type") == "null")]
        if options:
            return example_of(options[0], defs)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or "properties" in schema:
        return {name: example_of(sub, defs) for name, sub in _schema_object(schema, "properties").items()}
    if kind == "array":
        return [example_of(schema.get("items"), defs)]
    return {"integer": 2, "number": 1.5, "boolean": True, "null": None}.get(str(kind), "Paris")


def _function_tools(body: dict[str, Any]) -> dict[str, Any]:
    tools = body.get("tools")
    return (
        {
            t["function"]["name"]: t["function"].get("parameters")
            for t in tools
            if isinstance(t, dict) and isinstance(t.get("function"), dict) and "name" in t["function"]
        }
        if isinstance(tools, list)
        else {}
    )


def plan_of(body: dict[str, Any], script: Script) -> Plan:
    """The reply a request's tools, tool choice and response format call for."""
    messages = body.get("messages") or []
    last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
    if last.get("role") == "tool":
        return Plan(after_tool=True)
    tools = _function_tools(body)
    choice = body.get("tool_choice")
    name = None
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
    elif tools and (choice == "required" or (script.tool_calls and "get_weather" not in tools)):
        name = next(iter(tools))
    if name in tools and choice != "none":
        return Plan(tool=(name, _encode(example_of(tools[name])).decode()))
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        return Plan(json_content=_encode(example_of(schema)).decode())
    if isinstance(response_format, dict) and response_format.get("type") == "json_object":
        return Plan(json_content=_encode({"echo": _message_text(last)}).decode())
    return Plan()


@dataclass(slots=True)
class RecordedRequest:
    """A chat completion request as the upstream received it, for assertions."""

    path: str
    headers: CIMultiDictProxy[str]
    body: Any
    outcome: Outcome = "in_progress"


class BadRequest(Exception):
    """The request body is not a chat completion request this server can answer."""


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """The parts of a chat completion request that shape the scripted reply."""

    model: str
    last_user_text: str
    #: Texts of the tool results after the last user message (what an agent loop has gathered so far).
    tool_results: tuple[str, ...]
    #: `#agent N` in the last user message: the loop's length, whatever message comes last.
    agent_turns: int
    prompt_text: str
    n: int
    max_tokens: int | None
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int
    return_token_ids: bool
    plan: Plan = Plan()


def _message_text(message: Any) -> str:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def _int_field(body: dict[str, Any], name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise BadRequest(f"'{name}' must be an integer in [{low}, {high}]")
    return value


def parse_request(body: Any) -> ChatRequest:
    """Validate just enough of the body to script a reply; anything else is ignored like a lenient server."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array")
    last_user_index = next(
        (
            i
            for i in range(len(messages) - 1, -1, -1)
            if isinstance(messages[i], dict) and messages[i].get("role") == "user"
        ),
        None,
    )
    tool_results = tuple(
        _message_text(m)
        for m in messages[(last_user_index or 0) + 1 :]
        if isinstance(m, dict) and m.get("role") == "tool"
    )
    user_script = parse_script(
        _message_text(messages[last_user_index]) if last_user_index is not None else ""
    )
    last_user = next(
        (m for m in reversed(messages) if isinstance(m, dict) and m.get("role") in ("user", "tool")), None
    )
    max_tokens = _int_field(body, "max_completion_tokens", None, 0, 1 << 30)
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens", None, 0, 1 << 30)
    stream_options = body.get("stream_options")
    return ChatRequest(
        model=str(body.get("model") or MODELS[0]),
        last_user_text=_message_text(last_user) if last_user is not None else "",
        tool_results=tool_results,
        agent_turns=user_script.agent_turns,
        prompt_text=" ".join(_message_text(m) for m in messages),
        n=_int_field(body, "n", 1, 1, MAX_CHOICES) or 1,
        max_tokens=max_tokens,
        stream=body.get("stream") is True,
        include_usage=isinstance(stream_options, dict) and stream_options.get("include_usage") is True,
        logprobs=body.get("logprobs") is True,
        top_logprobs=_int_field(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS) or 0,
        return_token_ids=body.get("return_token_ids") is True,
        plan=plan_of(body, parse_script(_message_text(last_user) if last_user is not None else "")),
    )


def _logprob_entries(gen: Generation, start: int, stop: int, top: int) -> list[dict[str, Any]]:
    entries = []
    for position in range(start, stop):
        piece, logprob = gen.pieces[position], token_logprob(position)
        alternatives = [{"token": piece, "logprob": logprob, "bytes": list(piece.encode())}]
        alternatives += [
            {"token": f"alt{j}", "logprob": logprob - j, "bytes": list(f"alt{j}".encode())}
            for j in range(1, top)
        ]
        entries.append(
            {
                "token": piece,
                "logprob": logprob,
                "bytes": list(piece.encode()),
                "top_logprobs": alternatives[:top],
            }
        )
    return entries


class _Responder:
    """Builds response bodies and stream chunks for one request in the configured dialect."""

    def __init__(self, req: ChatRequest, seq: int, quirks: bool) -> None:
        self.req = req
        self.seq = seq
        self.quirks = quirks
        self.id = f"chatcmpl-scripted-{seq}"
        self.created = int(time.time())
        self.outputs = generate(
            req.last_user_text, req.n, req.max_tokens, req.plan, req.tool_results, req.agent_turns
        )
        self.prompt_ids = text_token_ids(req.prompt_text)

    @property
    def reasoning_field(self) -> str:
        """vLLM's name for a reasoning parser's output, or the one DeepSeek's API (and older vLLM) use."""
        return "reasoning" if self.quirks else "reasoning_content"

    def tool_call_id(self, choice: int, k: int) -> str:
        return (
            f"chatcmpl-tool-{self.seq:08x}{choice:02x}{k:02x}"
            if self.quirks
            else f"call_{self.seq}_{choice}_{k}"
        )

    def logprobs(self, gen: Generation, start: int, stop: int) -> dict[str, Any] | None:
        if not self.req.logprobs:
            return None
        entries = _logprob_entries(gen, start, stop, self.req.top_logprobs)
        return {"content": entries} if self.quirks else {"content": entries, "refusal": None}

    def usage(self) -> dict[str, Any]:
        completion = sum(len(gen.token_ids) for gen in self.outputs)
        prompt = len(self.prompt_ids)
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        if self.quirks:
            usage |= {"prompt_tokens_details": None, "completion_tokens_details": None}
        return usage

    def completion(self) -> bytes:
        choices = []
        for index, gen in enumerate(self.outputs):
            message: dict[str, Any] = {"role": "assistant", "content": gen.content, "refusal": gen.refusal}
            if gen.tool_calls:
                message["tool_calls"] = [
                    {
                        "id": self.tool_call_id(index, k),
                        "type": "function",
                        "function": {"name": name, "arguments": args},
                    }
                    for k, (name, args) in enumerate(gen.tool_calls)
                ]
            choice: dict[str, Any] = {
                "index": index,
                "message": message,
                "logprobs": self.logprobs(gen, 0, len(gen.pieces)),
                "finish_reason": gen.finish_reason,
            }
            if gen.reasoning is not None:
                message[self.reasoning_field] = gen.reasoning
            if self.quirks:
                message |= {"annotations": None, "audio": None, "function_call": None}
                message.setdefault("reasoning", None)
                choice |= {
                    "stop_reason": None,
                    "token_ids": list(gen.token_ids) if self.req.return_token_ids else None,
                }
            choices.append(choice)
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.req.model,
            "choices": choices,
            "usage": self.usage(),
            "service_tier": None,
            "system_fingerprint": None,
        }
        if self.quirks:
            body |= {
                "prompt_logprobs": None,
                "kv_transfer_params": None,
                "prompt_token_ids": self.prompt_ids if self.req.return_token_ids else None,
            }
        return _encode(body)

    def _chunk(self, choice: dict[str, Any], first: bool = False) -> bytes:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.req.model,
            "choices": [choice],
        }
        if self.quirks and first and self.req.return_token_ids:
            chunk["prompt_token_ids"] = self.prompt_ids
        if not self.quirks and self.req.include_usage:
            chunk["usage"] = None
        return b"data: " + _encode(chunk) + b"\n\n"

    def _deltas(self, index: int, gen: Generation) -> list[dict[str, Any]]:
        if gen.refusal is not None:
            return [{"refusal": piece} for piece in gen.pieces]
        if not gen.tool_calls:
            thinking = [{self.reasoning_field: word} for word in _tokenise((gen.reasoning or "").split())[0]]
            return [*thinking, *({"content": piece} for piece in gen.pieces)]
        deltas: list[dict[str, Any]] = []
        for k, (name, args) in enumerate(gen.tool_calls):
            half = len(args) // 2
            deltas.append(
                {
                    "tool_calls": [
                        {
                            "index": k,
                            "id": self.tool_call_id(index, k),
                            "type": "function",
                            "function": {"name": name, "arguments": ""},
                        }
                    ]
                }
            )
            deltas += [
                {"tool_calls": [{"index": k, "function": {"arguments": part}}]}
                for part in (args[:half], args[half:])
            ]
        return deltas

    def _choice_chunks(self, index: int, gen: Generation) -> list[bytes]:
        """Chunks after the role chunk for one choice; token ids and logprobs are spread so that
        concatenating them over the stream gives exactly the non-stream values."""
        deltas = self._deltas(index, gen) or [{"content": ""}]
        total, count = len(gen.pieces), len(deltas)
        chunks = []
        for j, delta in enumerate(deltas):
            start, stop = total * j // count, total * (j + 1) // count
            last = j == count - 1
            choice: dict[str, Any] = {
                "index": index,
                "delta": delta,
                "logprobs": self.logprobs(gen, start, stop),
                "finish_reason": gen.finish_reason if last and self.quirks else None,
            }
            if self.quirks:
                choice["token_ids"] = list(gen.token_ids[start:stop]) if self.req.return_token_ids else None
                if last:
                    choice["stop_reason"] = None
            chunks.append(self._chunk(choice))
        if not self.quirks:
            chunks.append(
                self._chunk(
                    {"index": index, "delta": {}, "logprobs": None, "finish_reason": gen.finish_reason}
                )
            )
        return chunks

    def stream_chunks(self) -> tuple[list[bytes], list[bytes]]:
        """(role chunks sent at once, remaining chunks in send order, ending with usage and [DONE])."""
        role_delta: dict[str, Any] = {"role": "assistant", "content": ""}
        if not self.quirks:
            role_delta["refusal"] = None
        head = [
            self._chunk(
                {"index": i, "delta": dict(role_delta), "logprobs": None, "finish_reason": None}, first=i == 0
            )
            for i in range(len(self.outputs))
        ]
        per_choice = [self._choice_chunks(i, gen) for i, gen in enumerate(self.outputs)]
        rest = [chunk for step in itertools.zip_longest(*per_choice) for chunk in step if chunk is not None]
        if self.req.include_usage:
            usage_chunk: dict[str, Any] = {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.req.model,
                "choices": [],
                "usage": self.usage(),
            }
            rest.append(b"data: " + _encode(usage_chunk) + b"\n\n")
        rest.append(_DONE)
        return head, rest


def _error_body(status: int, message: str, quirks: bool) -> bytes:
    if quirks:  # vLLM: type is the status phrase and code the integer status
        error: dict[str, Any] = {
            "message": message,
            "type": HTTPStatus(status).phrase.replace(" ", ""),
            "param": None,
            "code": status,
        }
    elif status == 429:
        error = {"message": message, "type": "requests", "param": None, "code": "rate_limit_exceeded"}
    else:
        kind = "invalid_request_error" if status < 500 else "server_error"
        error = {"message": message, "type": kind, "param": None, "code": None}
    return _encode({"error": error})


class _Handlers:
    """Route handlers sharing the server's configuration and request log."""

    def __init__(self, quirks: bool, log: list[RecordedRequest] | None) -> None:
        self.quirks = quirks
        self.log = log
        self.seq = itertools.count(1)
        created = int(time.time())
        models = []
        for name in MODELS:
            card: dict[str, Any] = {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "kaizen-tests",
            }
            if quirks:
                card |= {"root": name, "parent": None, "max_model_len": 4096, "permission": []}
            models.append(card)
        self.model_cards = models
        self.created = created
        self.adapters: dict[str, str] = {}  # loaded adapter name -> path

    async def health(self, _: web.Request) -> web.Response:
        return web.Response()

    async def models(self, _: web.Request) -> web.Response:
        cards = self.model_cards + [
            {"id": name, "object": "model", "created": self.created, "owned_by": "kaizen-tests", "root": path}
            for name, path in self.adapters.items()
        ]
        return web.Response(body=_encode({"object": "list", "data": cards}), headers=_JSON_HEADERS)

    async def load_adapter(self, request: web.Request) -> web.Response:
        body = _decode(await request.read())
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return self.error(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if name in self.adapters:
            return self.error(400, f"The lora adapter '{name}' has already been loaded.")
        if not await asyncio.to_thread(Path(path).is_dir):
            return self.error(404, f"Loading lora {name} failed: No adapter found for {path}")
        self.adapters[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_adapter(self, request: web.Request) -> web.Response:
        name = _decode(await request.read()).get("lora_name")
        if self.adapters.pop(name, None) is None:
            return self.error(404, f"The lora adapter '{name}' cannot be found.")
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    def error(self, status: int, message: str) -> web.Response:
        headers = {**_JSON_HEADERS, "Retry-After": "1"} if status == 429 else _JSON_HEADERS
        return web.Response(status=status, body=_error_body(status, message, self.quirks), headers=headers)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = _decode(raw)
        except msgspec.DecodeError:
            body = None
        record = None
        if self.log is not None:
            record = RecordedRequest(request.path, CIMultiDictProxy(CIMultiDict(request.headers)), body)
            self.log.append(record)
        try:
            response = await self._answer(request, body)
        except (asyncio.CancelledError, ConnectionResetError):
            if record is not None:
                record.outcome = "disconnected"
            raise
        if record is not None:
            record.outcome = "completed"
        return response

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """Legacy text completions: the reply is ``echo: <prompt>`` under the same word tokenizer, with token
        ids and ``token_logprobs`` laid out as vLLM does (per choice ``token_ids`` and ``prompt_token_ids``)."""
        body = await self._recorded_body(request)
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
            return self.error(400, "'prompt' must be a string")
        prompt = body["prompt"]
        script = parse_script(prompt)
        if script.error_status is not None:
            return self.error(script.error_status, f"scripted error {script.error_status}")
        max_tokens = body.get("max_tokens") if isinstance(body.get("max_tokens"), int) else None
        [gen] = generate(prompt, 1, max_tokens)
        seq = next(self.seq)
        ids = body.get("return_token_ids") is True
        logprobs = body.get("logprobs") if isinstance(body.get("logprobs"), int) else None

        def choice(start: int, stop: int, finish: str | None) -> dict[str, Any]:
            item: dict[str, Any] = {
                "index": 0,
                "text": "".join(gen.pieces[start:stop]),
                "finish_reason": finish,
            }
            item["logprobs"] = (
                {
                    "tokens": list(gen.pieces[start:stop]),
                    "token_logprobs": [token_logprob(i) for i in range(start, stop)],
                    "text_offset": [0] * (stop - start),
                    "top_logprobs": [{gen.pieces[i]: token_logprob(i)} for i in range(start, stop)],
                }
                if logprobs is not None
                else None
            )
            if ids:
                item["token_ids"] = list(gen.token_ids[start:stop])
                item["prompt_token_ids"] = text_token_ids(prompt) if start == 0 else None
            return item

        prompt_tokens = len(text_token_ids(prompt))
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(gen.pieces),
            "total_tokens": prompt_tokens + len(gen.pieces),
        }
        head = {
            "id": f"cmpl-scripted-{seq}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model"),
        }
        if body.get("stream") is not True:
            return web.Response(
                body=_encode(
                    {**head, "choices": [choice(0, len(gen.pieces), gen.finish_reason)], "usage": usage}
                ),
                headers=_JSON_HEADERS,
            )
        chunks = [
            b"data: "
            + _encode(
                {
                    **head,
                    "choices": [choice(i, i + 1, gen.finish_reason if i == len(gen.pieces) - 1 else None)],
                }
            )
            + b"\n\n"
            for i in range(len(gen.pieces))
        ]
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage") is True:
            chunks.append(b"data: " + _encode({**head, "choices": [], "usage": usage}) + b"\n\n")
        return await self._stream(request, [], [*chunks, _DONE], script.slow_ms)

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        """Deterministic 8-dimensional vectors: one per input text, from the words' ids."""
        body = await self._recorded_body(request)
        texts = body.get("input") if isinstance(body, dict) else None
        texts = [texts] if isinstance(texts, str) else texts
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            return self.error(400, "'input' must be a string or a list of strings")
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": [((token_id(text) >> k) % 97) / 97 for k in range(8)],
            }
            for i, text in enumerate(texts)
        ]
        tokens = sum(len(text.split()) for text in texts)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return web.Response(
            body=_encode({"object": "list", "model": body.get("model"), "data": data, "usage": usage}),
            headers=_JSON_HEADERS,
        )

    async def _recorded_body(self, request: web.Request) -> Any:
        try:
            body = _decode(await request.read())
        except msgspec.DecodeError:
            body = None
        if self.log is not None:
            self.log.append(
                RecordedRequest(
                    request.path, CIMultiDictProxy(CIMultiDict(request.headers)), body, "completed"
                )
            )
        return body

    async def _answer(self, request: web.Request, body: Any) -> web.StreamResponse:
        try:
            req = parse_request(body)
        except BadRequest as exc:
            return self.error(400, str(exc))
        script = parse_script(req.last_user_text)
        if script.hang:
            await asyncio.Future()  # cancelled when the client goes away or the server stops
        if script.error_status is not None:
            return self.error(script.error_status, f"scripted error {script.error_status}")
        if script.garbage:
            if req.stream:
                return await self._stream(
                    request, [b'data: {"id": "chatcmpl-garbage", "choi\n\n'], [_DONE], 0
                )
            return web.Response(body=b'{"id": "chatcmpl-garbage", "choices": [', headers=_JSON_HEADERS)
        responder = _Responder(req, next(self.seq), self.quirks)
        if req.stream:
            head, rest = responder.stream_chunks()
            return await self._stream(request, head, rest, script.slow_ms)
        if script.slow_ms:
            await asyncio.sleep(script.slow_ms / 1000)
        return web.Response(body=responder.completion(), headers=_JSON_HEADERS)

    async def _stream(
        self, request: web.Request, head: list[bytes], rest: list[bytes], slow_ms: int
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers=_SSE_HEADERS)
        await response.prepare(request)
        await response.write(b"".join(head))
        for chunk in rest:  # one write per chunk, like a real engine, so readers see split events
            if slow_ms:
                await asyncio.sleep(slow_ms / 1000)
            await response.write(chunk)
        await response.write_eof()
        return response


def build_app(*, vllm_quirks: bool = True, log: list[RecordedRequest] | None = None) -> web.Application:
    """The aiohttp application; ``log`` receives every chat completion request when given."""
    handlers = _Handlers(vllm_quirks, log)
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_post("/v1/embeddings", handlers.embeddings)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_post("/v1/load_lora_adapter", handlers.load_adapter)
    app.router.add_post("/v1/unload_lora_adapter", handlers.unload_adapter)
    app.router.add_get("/health", handlers.health)
    return app


def _make_runner(app: web.Application) -> web.AppRunner:
    # No access log on the hot path; cancel handlers whose client left (``#hang``, ``#slow``);
    # don't wait long for them at shutdown.
    return web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=0.5)


@dataclass
class ScriptedUpstream:
    """The scripted server on a background thread with its own event loop, for use from tests.

    ``with ScriptedUpstream() as upstream: OpenAI(base_url=upstream.url, ...)``
    """

    host: str = "127.0.0.1"
    port: int = 0
    vllm_quirks: bool = True
    requests: list[RecordedRequest] = field(default_factory=list)
    _server: BackgroundServer | None = field(default=None, init=False, repr=False)

    @property
    def root_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """Base URL in the OpenAI SDK's sense (ends in ``/v1``)."""
        return f"{self.root_url}/v1"

    def chat_requests(self) -> list[Any]:
        """JSON bodies of the chat completion requests received so far, oldest first."""
        return [record.body for record in self.requests]

    def wait_for_requests(self, count: int, timeout: float = 5.0) -> list[RecordedRequest]:
        """Block until ``count`` chat requests arrived (for calls the gateway makes in the background)."""
        deadline = time.monotonic() + timeout
        while len(self.requests) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"expected {count} upstream requests, got {len(self.requests)}")
            time.sleep(0.005)
        return list(self.requests)

    def start(self) -> ScriptedUpstream:
        runner = _make_runner(build_app(vllm_quirks=self.vllm_quirks, log=self.requests))
        self._server = BackgroundServer(runner, self.host, self.port, "scripted-upstream")
        self.port = self._server.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def __enter__(self) -> ScriptedUpstream:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


async def _serve_forever(host: str, port: int, vllm_quirks: bool) -> None:
    runner = _make_runner(build_app(vllm_quirks=vllm_quirks))
    await runner.setup()
    await web.TCPSite(runner, host, port, reuse_address=True).start()
    logger.info("scripted upstream listening on http://%s:%d/v1 (vllm_quirks=%s)", host, port, vllm_quirks)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--conformant", action="store_true", help="answer like OpenAI instead of like vLLM")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        import uvloop
    except ImportError:  # optional: only makes the standalone server faster
        run = asyncio.run
    else:
        run = uvloop.run
    with contextlib.suppress(KeyboardInterrupt):
        run(_serve_forever(args.host, args.port, not args.conformant))


if __name__ == "__main__":
    main()
