"""Turn whatever an engine returns into spec-conformant responses and stream chunks, and collect what capture
needs (assembled reply, sampled token ids, behaviour logprobs, usage) on the way.

Engines differ from the spec in small ways (vLLM sends `null` for absent objects, omits `refusal` in logprobs,
adds its own fields), so output is rebuilt field by field from `gateway.protocol` models instead of patched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar, cast

from gateway.errors import EngineBadResponse
from gateway.protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    CompletionChoice,
    CompletionLogprobs,
    Delta,
    Embedding,
    EmbeddingList,
    EmbeddingUsage,
    FinishReason,
    ResponseFunction,
    ResponseMessage,
    ResponseToolCall,
    TextCompletion,
    TokenLogprob,
    ToolCallChunk,
    ToolCallChunkFunction,
    TopLogprob,
    Usage,
)

_FINISH_REASONS = {"stop", "length", "tool_calls", "content_filter", "function_call"}
# A reasoning parser's output beside the content, under either name engines use for it; relayed as sent.
REASONING_FIELDS = ("reasoning", "reasoning_content")


def _finish_reason(value: Any, *, has_tool_calls: bool) -> FinishReason:
    if value in _FINISH_REASONS:
        return cast(FinishReason, value)
    if has_tool_calls:
        return "tool_calls"
    return "length" if value == "max_tokens" else "stop"


def _usage(raw: Any) -> Usage | None:
    if not isinstance(raw, dict):
        return None
    prompt = int(raw.get("prompt_tokens") or 0)
    completion = int(raw.get("completion_tokens") or 0)
    usage = Usage(prompt, completion, int(raw.get("total_tokens") or prompt + completion))
    for name in ("prompt_tokens_details", "completion_tokens_details"):
        details = raw.get(name)
        if isinstance(details, dict):
            clean = {k: v for k, v in details.items() if isinstance(v, int)}
            if clean:
                setattr(usage, name, clean)
    return usage


def _token_logprob(raw: dict[str, Any]) -> TokenLogprob:
    top = raw.get("top_logprobs") or []
    return TokenLogprob(
        token=str(raw.get("token", "")),
        logprob=float(raw.get("logprob", -9999.0)),
        bytes=raw.get("bytes"),
        top_logprobs=[
            TopLogprob(str(t.get("token", "")), float(t.get("logprob", -9999.0)), t.get("bytes"))
            for t in top
            if isinstance(t, dict)
        ],
    )


def _logprob_entries(raw: Any) -> list[dict[str, Any]]:
    if isinstance(raw, dict) and isinstance(raw.get("content"), list):
        return [e for e in raw["content"] if isinstance(e, dict)]
    return []


def _client_logprobs(raw: Any) -> ChoiceLogprobs | None:
    if not isinstance(raw, dict):
        return None
    refusal = raw.get("refusal")
    return ChoiceLogprobs(
        content=[_token_logprob(e) for e in _logprob_entries(raw)]
        if raw.get("content") is not None
        else None,
        refusal=[_token_logprob(e) for e in refusal if isinstance(e, dict)]
        if isinstance(refusal, list)
        else None,
    )


def _dict(raw: Any) -> dict[str, Any]:
    return raw if isinstance(raw, dict) else {}


def _index(item: dict[str, Any], position: int) -> int:
    index = item.get("index")
    return index if isinstance(index, int) else position


def _int_list(raw: Any) -> list[int] | None:
    if isinstance(raw, list) and all(isinstance(t, int) for t in raw):
        return raw
    return None


def _tool_calls(raw: Any) -> list[ResponseToolCall]:
    calls = []
    for item in raw if isinstance(raw, list) else []:
        fn = item.get("function") if isinstance(item, dict) else None
        if not isinstance(fn, dict):
            continue
        calls.append(
            ResponseToolCall(
                id=str(item.get("id") or ""),
                function=ResponseFunction(str(fn.get("name") or ""), str(fn.get("arguments") or "")),
            )
        )
    return calls


@dataclass
class Captured:
    """What capture stores about the engine's answer, beyond what the client sees."""

    response: dict[str, Any]
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[list[int] | None] | None = None
    completion_logprobs: list[list[float] | None] | None = None
    usage: dict[str, Any] | None = None


def normalize_completion(
    raw: Any, *, response_id: str, model: str, keep_logprobs: bool
) -> tuple[ChatCompletion, Captured]:
    """Rebuild a non-streamed engine answer as a conformant `ChatCompletion`."""
    if not isinstance(raw, dict) or not isinstance(raw.get("choices"), list):
        raise EngineBadResponse("the engine returned a response without a `choices` list")
    choices: list[Choice] = []
    token_ids: list[list[int] | None] = []
    behaviour: list[list[float] | None] = []
    stored: list[dict[str, Any]] = []
    for position, item in enumerate(raw["choices"]):
        if not isinstance(item, dict):
            raise EngineBadResponse("the engine returned a malformed choice")
        message = _dict(item.get("message"))
        content = message.get("content")
        tool_calls = _tool_calls(message.get("tool_calls"))
        finish = _finish_reason(item.get("finish_reason"), has_tool_calls=bool(tool_calls))
        reply = ResponseMessage(
            content=content if isinstance(content, str) else None,
            refusal=message.get("refusal") if isinstance(message.get("refusal"), str) else None,
        )
        if tool_calls:
            reply.tool_calls = tool_calls
        reasoning = {name: message[name] for name in REASONING_FIELDS if isinstance(message.get(name), str)}
        for name, text in reasoning.items():
            setattr(reply, name, text)
        index = _index(item, position)
        logprobs = item.get("logprobs")
        choices.append(Choice(index, reply, finish, _client_logprobs(logprobs) if keep_logprobs else None))
        entries = _logprob_entries(logprobs)
        behaviour.append([float(e.get("logprob", 0.0)) for e in entries] if entries else None)
        token_ids.append(_int_list(item.get("token_ids")))
        stored.append(
            {
                "index": index,
                "message": {
                    "role": "assistant",
                    "content": reply.content,
                    **({"refusal": reply.refusal} if reply.refusal is not None else {}),
                    **({"tool_calls": [_tool_call_dict(c) for c in tool_calls]} if tool_calls else {}),
                    **reasoning,
                },
                "finish_reason": finish,
            }
        )
    usage = _usage(raw.get("usage"))
    created = raw.get("created")
    completion = ChatCompletion(
        id=response_id,
        created=int(created) if isinstance(created, int | float) else 0,
        model=model,
        choices=choices,
    )
    if usage is not None:
        completion.usage = usage
    captured = Captured(
        response={"choices": stored},
        prompt_token_ids=_int_list(raw.get("prompt_token_ids")),
        completion_token_ids=token_ids if any(t is not None for t in token_ids) else None,
        completion_logprobs=behaviour if any(b is not None for b in behaviour) else None,
        usage=_usage_dict(usage),
    )
    return completion, captured


def _tool_call_dict(call: ResponseToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": call.function.arguments},
    }


def _usage_dict(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


@dataclass
class _ChoiceState:
    content: list[str] = field(default_factory=list)
    refusal: list[str] = field(default_factory=list)
    reasoning: dict[str, list[str]] = field(default_factory=dict)  # by the engine's name for it
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: FinishReason | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class _TokenState(Protocol):
    token_ids: list[int]
    logprobs: list[float]


ChoiceState = TypeVar("ChoiceState", bound=_TokenState)


class _ChunkReader(Generic[ChoiceState]):
    """What chat and text completion streams share: the reply's id, creation time, usage and prompt ids, and
    each choice's state by index."""

    def __init__(self, *, response_id: str, model: str, keep_logprobs: bool, keep_usage: bool) -> None:
        self.response_id = response_id
        self.model = model
        self.keep_logprobs = keep_logprobs
        self.keep_usage = keep_usage
        self.created = 0
        self.prompt_token_ids: list[int] | None = None
        self.usage: Usage | None = None
        self.choices: dict[int, ChoiceState] = {}

    def _header(self, raw: Any) -> tuple[dict[str, Any], Usage | None]:
        """Check a decoded engine chunk and take its creation time and usage; returns (chunk, its usage)."""
        if not isinstance(raw, dict):
            raise EngineBadResponse("the engine sent a malformed stream chunk")
        if not self.created and isinstance(raw.get("created"), int | float):
            self.created = int(raw["created"])
        usage = _usage(raw.get("usage"))
        if usage is not None:
            self.usage = usage
        return raw, usage

    def _captured(self, stored: list[dict[str, Any]]) -> Captured:
        """The reply for capture: `stored`, each choice's assembled part in index order, with the sampled token
        ids and logprobs of every choice (None where the engine sent none)."""
        states = [self.choices[i] for i in sorted(self.choices)]
        token_ids = [s.token_ids or None for s in states]
        logprobs = [s.logprobs or None for s in states]
        return Captured(
            response={"choices": stored},
            prompt_token_ids=self.prompt_token_ids,
            completion_token_ids=token_ids if any(token_ids) else None,
            completion_logprobs=logprobs if any(logprobs) else None,
            usage=_usage_dict(self.usage),
        )


class StreamAssembler(_ChunkReader[_ChoiceState]):
    """Normalises stream chunks one by one and assembles the full reply (for capture) as they pass."""

    def feed(self, raw: Any) -> ChatCompletionChunk | None:
        """Take one decoded engine chunk; return the chunk to send the client, or None to send nothing."""
        raw, usage = self._header(raw)
        prompt_ids = _int_list(raw.get("prompt_token_ids"))
        if prompt_ids is not None:
            self.prompt_token_ids = prompt_ids
        out: list[ChunkChoice] = []
        for position, item in enumerate(raw.get("choices") or []):
            if isinstance(item, dict):
                out.append(self._feed_choice(position, item))
        if not out and (usage is None or not self.keep_usage):
            return None
        chunk = ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model, choices=out)
        if self.keep_usage:
            chunk.usage = usage if usage is not None and not out else None
        return chunk

    def _feed_choice(self, position: int, item: dict[str, Any]) -> ChunkChoice:
        index = _index(item, position)
        state = self.choices.setdefault(index, _ChoiceState())
        raw_delta = _dict(item.get("delta"))
        delta = Delta()
        if raw_delta.get("role") == "assistant":
            delta.role = "assistant"
        content = raw_delta.get("content")
        if isinstance(content, str):
            delta.content = content
            state.content.append(content)
        refusal = raw_delta.get("refusal")
        if isinstance(refusal, str):
            delta.refusal = refusal
            state.refusal.append(refusal)
        for name in REASONING_FIELDS:
            text = raw_delta.get(name)
            if isinstance(text, str):
                setattr(delta, name, text)
                state.reasoning.setdefault(name, []).append(text)
        chunks = self._tool_call_chunks(state, raw_delta.get("tool_calls"))
        if chunks:
            delta.tool_calls = chunks
        ids = _int_list(item.get("token_ids"))
        if ids:
            state.token_ids.extend(ids)
        logprobs = item.get("logprobs")
        state.logprobs.extend(float(e.get("logprob", 0.0)) for e in _logprob_entries(logprobs))
        finish = item.get("finish_reason")
        finish_reason = (
            _finish_reason(finish, has_tool_calls=bool(state.tool_calls)) if finish is not None else None
        )
        if finish_reason is not None:
            state.finish_reason = finish_reason
        choice = ChunkChoice(index, delta, finish_reason)
        if self.keep_logprobs:
            choice.logprobs = _client_logprobs(logprobs)
        return choice

    @staticmethod
    def _tool_call_chunks(state: _ChoiceState, raw: Any) -> list[ToolCallChunk]:
        chunks = []
        for position, item in enumerate(raw if isinstance(raw, list) else []):
            if not isinstance(item, dict):
                continue
            index = _index(item, position)
            call = state.tool_calls.setdefault(index, {"id": "", "name": "", "arguments": []})
            chunk = ToolCallChunk(index=index)
            if isinstance(item.get("id"), str):
                call["id"] = chunk.id = item["id"]
                chunk.type = "function"
            fn = item.get("function")
            if isinstance(fn, dict):
                function = ToolCallChunkFunction()
                if isinstance(fn.get("name"), str):
                    call["name"] = function.name = fn["name"]
                if isinstance(fn.get("arguments"), str):
                    call["arguments"].append(fn["arguments"])
                    function.arguments = fn["arguments"]
                chunk.function = function
            chunks.append(chunk)
        return chunks

    @property
    def output_seen(self) -> bool:
        return any(s.content or s.refusal or s.tool_calls or s.reasoning for s in self.choices.values())

    def captured(self) -> Captured:
        """The reply as assembled so far (complete after the last chunk, partial after a disconnect)."""
        stored = []
        for index in sorted(self.choices):
            state = self.choices[index]
            message: dict[str, Any] = {"role": "assistant", "content": "".join(state.content) or None}
            if state.refusal:
                message["refusal"] = "".join(state.refusal)
            for name, parts in state.reasoning.items():
                message[name] = "".join(parts)
            if state.tool_calls:
                message["tool_calls"] = [
                    {
                        "id": c["id"],
                        "type": "function",
                        "function": {"name": c["name"], "arguments": "".join(c["arguments"])},
                    }
                    for _, c in sorted(state.tool_calls.items())
                ]
            stored.append({"index": index, "message": message, "finish_reason": state.finish_reason})
        return self._captured(stored)


# ----------------------------------------------------------------------------- text completions and embeddings
_TEXT_FINISH = {"stop", "length", "content_filter"}


def _text_finish(value: Any) -> Literal["stop", "length", "content_filter"]:
    if value in _TEXT_FINISH:
        return cast(Literal["stop", "length", "content_filter"], value)
    return "length" if value == "max_tokens" else "stop"


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _text_logprobs(raw: Any) -> CompletionLogprobs | None:
    if not isinstance(raw, dict):
        return None
    logprobs = CompletionLogprobs()
    for name in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
        value = raw.get(name)
        if isinstance(value, list):
            setattr(logprobs, name, value)
    return logprobs


def _behaviour(raw: Any) -> list[float]:
    """The sampled tokens' logprobs of a text completion choice (`token_logprobs`, nulls for echoed prompt)."""
    values = raw.get("token_logprobs") if isinstance(raw, dict) else None
    return [float(v) for v in values or [] if isinstance(v, int | float)]


def normalize_text_completion(
    raw: Any, *, response_id: str, model: str, keep_logprobs: bool
) -> tuple[TextCompletion, Captured]:
    """Rebuild a non-streamed `/completions` answer as a conformant `CreateCompletionResponse`."""
    if not isinstance(raw, dict) or not isinstance(raw.get("choices"), list):
        raise EngineBadResponse("the engine returned a response without a `choices` list")
    choices: list[CompletionChoice] = []
    stored: list[dict[str, Any]] = []
    token_ids: list[list[int] | None] = []
    behaviour: list[list[float] | None] = []
    prompt_ids: list[list[int] | None] = []
    for position, item in enumerate(raw["choices"]):
        if not isinstance(item, dict):
            raise EngineBadResponse("the engine returned a malformed choice")
        index = _index(item, position)
        text = _str(item.get("text"))
        finish = _text_finish(item.get("finish_reason"))
        logprobs = item.get("logprobs")
        choices.append(
            CompletionChoice(finish, index, _text_logprobs(logprobs) if keep_logprobs else None, text)
        )
        stored.append({"index": index, "text": text, "finish_reason": finish})
        token_ids.append(_int_list(item.get("token_ids")))
        behaviour.append(_behaviour(logprobs) or None)
        prompt_ids.append(_int_list(item.get("prompt_token_ids")))
    usage = _usage(raw.get("usage"))
    created = raw.get("created")
    completion = TextCompletion(
        id=response_id,
        choices=choices,
        created=int(created) if isinstance(created, int | float) else 0,
        model=model,
    )
    if usage is not None:
        completion.usage = usage
    # One prompt's ids (every choice of one prompt shares them); a batch of prompts keeps none.
    distinct = {tuple(p) for p in prompt_ids if p is not None}
    captured = Captured(
        response={"choices": stored},
        prompt_token_ids=list(distinct.pop())
        if len(distinct) == 1
        else _int_list(raw.get("prompt_token_ids")),
        completion_token_ids=token_ids if any(t is not None for t in token_ids) else None,
        completion_logprobs=behaviour if any(b is not None for b in behaviour) else None,
        usage=_usage_dict(usage),
    )
    return completion, captured


@dataclass
class _TextState:
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class TextStreamAssembler(_ChunkReader[_TextState]):
    """Normalises `/completions` stream chunks and assembles each choice's text for capture."""

    def feed(self, raw: Any) -> TextCompletion | None:
        raw, usage = self._header(raw)
        out: list[CompletionChoice] = []
        for position, item in enumerate(raw.get("choices") or []):
            if not isinstance(item, dict):
                continue
            index = _index(item, position)
            state = self.choices.setdefault(index, _TextState())
            text = _str(item.get("text"))
            state.text.append(text)
            prompt_ids = _int_list(item.get("prompt_token_ids"))
            if prompt_ids and self.prompt_token_ids is None:
                self.prompt_token_ids = prompt_ids
            state.token_ids.extend(_int_list(item.get("token_ids")) or [])
            logprobs = item.get("logprobs")
            state.logprobs.extend(_behaviour(logprobs))
            finish = (
                _text_finish(item.get("finish_reason")) if item.get("finish_reason") is not None else None
            )
            state.finish_reason = finish or state.finish_reason
            out.append(
                CompletionChoice(
                    finish, index, _text_logprobs(logprobs) if self.keep_logprobs else None, text
                )
            )
        if not out and (usage is None or not self.keep_usage):
            return None
        chunk = TextCompletion(id=self.response_id, choices=out, created=self.created, model=self.model)
        if self.keep_usage and usage is not None and not out:  # only on the last chunk (the spec has no null)
            chunk.usage = usage
        return chunk

    @property
    def output_seen(self) -> bool:
        return any("".join(s.text) for s in self.choices.values())

    def captured(self) -> Captured:
        return self._captured(
            [
                {
                    "index": i,
                    "text": "".join(self.choices[i].text),
                    "finish_reason": self.choices[i].finish_reason,
                }
                for i in sorted(self.choices)
            ]
        )


def normalize_embeddings(raw: Any, *, model: str) -> EmbeddingList:
    """Rebuild an `/embeddings` answer as a conformant `CreateEmbeddingResponse`."""
    if not isinstance(raw, dict) or not isinstance(raw.get("data"), list):
        raise EngineBadResponse("the engine returned embeddings without a `data` list")
    data = []
    for position, item in enumerate(raw["data"]):
        vector = item.get("embedding") if isinstance(item, dict) else None
        if not isinstance(vector, list | str):
            raise EngineBadResponse("the engine returned a malformed embedding")
        data.append(Embedding(_index(item, position), vector))
    usage = _dict(raw.get("usage"))
    prompt = int(usage.get("prompt_tokens") or 0)
    return EmbeddingList(model, data, EmbeddingUsage(prompt, int(usage.get("total_tokens") or prompt)))
