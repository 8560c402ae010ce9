"""Build Responses API objects from chat replies: the `Response` of a call and, for a stream, the typed event
sequence OpenAI sends, made from the conformant chat chunks as they pass.

Item ids derive from the call id (`msg_<call id>`, `fc_<call id>_<n>`), so the streamed items, the final
response and the stored one name the same items, and an `item_reference` finds its response.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import msgspec
from msgspec import UNSET

from gateway.normalize import Captured
from gateway.protocol import ChatCompletion, ChatCompletionChunk, ChoiceLogprobs, TokenLogprob, Usage
from gateway.responses.protocol import (
    CreateResponseRequest,
    IncompleteDetails,
    InputTokensDetails,
    ItemStatus,
    LogProb,
    OutputItem,
    OutputTokensDetails,
    Response,
    ResponseCompletedEvent,
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseCreatedEvent,
    ResponseError,
    ResponseFailedEvent,
    ResponseFunctionCall,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseIncompleteEvent,
    ResponseInProgressEvent,
    ResponseLogProb,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseRefusal,
    ResponseRefusalDeltaEvent,
    ResponseRefusalDoneEvent,
    ResponsesFunctionTool,
    ResponseStatus,
    ResponseStreamEvent,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
    ResponseTextParam,
    ResponseTopLogprob,
    ResponseUsage,
    TopLogProb,
)

_encode = msgspec.json.Encoder().encode


def response_id(call_id: str) -> str:
    return f"resp_{call_id}"


def call_id_of(item_or_response_id: str) -> str | None:
    """The call id inside a response id (`resp_<id>`), an output item id (`msg_<id>`, `fc_<id>_<n>`) or the id
    of an input item the client gave none (`in_<id>_<n>`)."""
    prefix, _, rest = item_or_response_id.partition("_")
    if prefix in ("resp", "msg"):
        return rest or None
    if prefix in ("fc", "in"):
        call, _, position = rest.rpartition("_")
        return call if call and position.isdigit() else None
    return None


def message_item_id(call_id: str) -> str:
    return f"msg_{call_id}"


def function_call_item_id(call_id: str, position: int) -> str:
    return f"fc_{call_id}_{position}"


@dataclass
class ResponseShape:
    """What a response echoes of its request, and its identity."""

    call_id: str
    created_at: int
    request: CreateResponseRequest
    tools: list[ResponsesFunctionTool]
    logprobs: bool  # the client included `message.output_text.logprobs`
    completed_at: int | None = None  # taken once: the stored and the returned response agree on it

    @property
    def id(self) -> str:
        return response_id(self.call_id)

    def response(
        self,
        status: ResponseStatus,
        output: list[OutputItem],
        *,
        usage: ResponseUsage | None = None,
        incomplete: IncompleteDetails | None = None,
        error: ResponseError | None = None,
    ) -> Response:
        r = self.request
        if status == "completed" and self.completed_at is None:
            self.completed_at = int(time.time())
        response = Response(
            metadata=r.metadata or {},
            temperature=r.temperature,
            top_p=r.top_p,
            previous_response_id=r.previous_response_id,
            model=r.model,
            max_tool_calls=r.max_tool_calls,
            text=r.text or ResponseTextParam(),
            tools=self.tools,
            tool_choice=r.tool_choice if r.tool_choice is not None else "auto",
            truncation=r.truncation or "disabled",
            id=self.id,
            status=status,
            created_at=self.created_at,
            completed_at=self.completed_at if status == "completed" else None,
            error=error,
            incomplete_details=incomplete,
            output=output,
            reasoning=r.reasoning,
            instructions=r.instructions,
            parallel_tool_calls=r.parallel_tool_calls if r.parallel_tool_calls is not None else True,
            max_output_tokens=r.max_output_tokens,
        )
        for name in ("top_logprobs", "user", "safety_identifier", "prompt_cache_key"):
            value = getattr(r, name)
            if value is not None:
                setattr(response, name, value)
        if usage is not None:
            response.usage = usage
        return response

    def finished(
        self, output: list[OutputItem], finish_reason: str | None, usage: ResponseUsage | None
    ) -> Response:
        """The response once the engine is done: incomplete when it stopped at the token limit or a filter."""
        if finish_reason == "length":
            details = IncompleteDetails("max_output_tokens")
            return self.response("incomplete", output, usage=usage, incomplete=details)
        if finish_reason == "content_filter":
            details = IncompleteDetails("content_filter")
            return self.response("incomplete", output, usage=usage, incomplete=details)
        return self.response("completed", output, usage=usage)


# ----------------------------------------------------------------------------- usage and logprobs


def response_usage(usage: Usage | Mapping[str, Any] | None) -> ResponseUsage | None:
    """Chat usage in the Responses API's terms (input/output tokens)."""
    if usage is None:
        return None
    if isinstance(usage, Usage):
        prompt, completion, total = usage.prompt_tokens, usage.completion_tokens, usage.total_tokens
        prompt_details = usage.prompt_tokens_details or {}
        completion_details = usage.completion_tokens_details or {}
    else:
        prompt = int(usage.get("prompt_tokens") or 0)
        completion = int(usage.get("completion_tokens") or 0)
        total = int(usage.get("total_tokens") or prompt + completion)
        prompt_details = completion_details = {}
    return ResponseUsage(
        input_tokens=prompt,
        input_tokens_details=InputTokensDetails(cached_tokens=int(prompt_details.get("cached_tokens", 0))),
        output_tokens=completion,
        output_tokens_details=OutputTokensDetails(
            reasoning_tokens=int(completion_details.get("reasoning_tokens", 0))
        ),
        total_tokens=total,
    )


def _bytes(token: str, raw: list[int] | None) -> list[int]:
    return raw if raw is not None else list(token.encode())


def _logprobs(entries: Sequence[TokenLogprob]) -> list[LogProb]:
    return [
        LogProb(
            e.token,
            e.logprob,
            _bytes(e.token, e.bytes),
            [TopLogProb(t.token, t.logprob, _bytes(t.token, t.bytes)) for t in e.top_logprobs],
        )
        for e in entries
    ]


def _delta_logprobs(entries: Sequence[TokenLogprob]) -> list[ResponseLogProb]:
    return [
        ResponseLogProb(e.token, e.logprob, [ResponseTopLogprob(t.token, t.logprob) for t in e.top_logprobs])
        for e in entries
    ]


def _entries(logprobs: object) -> list[TokenLogprob]:
    """The per-token entries of a choice's (or chunk's) logprobs, which may be absent."""
    if isinstance(logprobs, ChoiceLogprobs) and logprobs.content:
        return logprobs.content
    return []


# ----------------------------------------------------------------------------- whole responses


def output_items(
    call_id: str,
    content: str | None,
    refusal: str | None,
    tool_calls: Sequence[tuple[str, str, str]],
    *,
    logprobs: list[LogProb] | None = None,
    status: ResponseStatus = "completed",
) -> list[OutputItem]:
    """The output of a reply: a message (unless the reply is only tool calls), then one item per call."""
    item_status: ItemStatus = "incomplete" if status == "incomplete" else "completed"
    items: list[OutputItem] = []
    if content or refusal or not tool_calls:
        parts: list[ResponseOutputText | ResponseRefusal] = []
        if refusal:
            parts.append(ResponseRefusal(refusal))
        if content or not refusal:
            parts.append(ResponseOutputText(content or "", [], logprobs or []))
        items.append(ResponseOutputMessage(id=message_item_id(call_id), content=parts, status=item_status))
    for position, (tool_call_id, name, arguments) in enumerate(tool_calls):
        items.append(
            ResponseFunctionCall(
                id=function_call_item_id(call_id, position),
                call_id=tool_call_id,
                name=name,
                arguments=arguments,
                status="completed",
            )
        )
    return items


def _final(
    shape: ResponseShape, finish_reason: str | None, usage: ResponseUsage | None, **reply: Any
) -> Response:
    status: ResponseStatus = "incomplete" if finish_reason in ("length", "content_filter") else "completed"
    return shape.finished(output_items(shape.call_id, status=status, **reply), finish_reason, usage)


def from_completion(shape: ResponseShape, completion: ChatCompletion) -> Response:
    """The response of a non-streamed call, from the conformant chat completion the engine's answer became."""
    usage = response_usage(completion.usage if isinstance(completion.usage, Usage) else None)
    if not completion.choices:  # an engine that answered no choice answered nothing
        return _final(shape, None, usage, content=None, refusal=None, tool_calls=[])
    choice = completion.choices[0]
    message = choice.message
    calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]
    logprobs = _logprobs(_entries(choice.logprobs)) if shape.logprobs else None
    return _final(
        shape,
        choice.finish_reason,
        usage,
        content=message.content,
        refusal=message.refusal,
        tool_calls=calls,
        logprobs=logprobs,
    )


def captured_reply(captured: Captured) -> dict[str, Any]:
    """The choice a response is made of; an engine that answered no choice answered an empty message."""
    choices = captured.response.get("choices") or []
    return dict(choices[0]) if choices else {"message": {"role": "assistant", "content": None}}


def from_captured(shape: ResponseShape, captured: Captured) -> Response:
    """The response as it is stored, from what capture keeps of the reply (no logprobs)."""
    choice = captured_reply(captured)
    message = choice["message"]
    calls = [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []
    ]
    return _final(
        shape,
        choice.get("finish_reason"),
        response_usage(captured.usage),
        content=message.get("content"),
        refusal=message.get("refusal"),
        tool_calls=calls,
    )


def encode(response: Response) -> bytes:
    return _encode(response)


def to_builtins(response: Response) -> dict[str, Any]:
    return cast(dict[str, Any], msgspec.to_builtins(response))


# ----------------------------------------------------------------------------- streams


_EVENT_LINES: dict[type, bytes] = {}


def encode_event(event: ResponseStreamEvent) -> bytes:
    """One server-sent event, named by its type as OpenAI names its events."""
    kind = type(event)
    line = _EVENT_LINES.get(kind)
    if line is None:
        line = _EVENT_LINES[kind] = b"event: " + str(kind.__struct_config__.tag).encode() + b"\ndata: "
    return line + _encode(event) + b"\n\n"


PartKind = Literal["text", "refusal"]


@dataclass
class _StreamedItem:
    output_index: int
    item_id: str
    parts: list[PartKind] = field(default_factory=list)  # a message's content parts, in the order they opened
    text: list[str] = field(default_factory=list)
    refusal: list[str] = field(default_factory=list)
    logprobs: list[LogProb] = field(default_factory=list)
    call_id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)

    @property
    def is_message(self) -> bool:
        return not self.call_id

    def content(self) -> list[ResponseOutputText | ResponseRefusal]:
        return [
            ResponseOutputText("".join(self.text), [], self.logprobs)
            if kind == "text"
            else ResponseRefusal("".join(self.refusal))
            for kind in self.parts
        ]


class ResponseEvents:
    """The Responses event sequence of one streamed call, fed the conformant chat chunks one by one.

    Items open as the reply reaches them (text first, then each tool call) and are closed, in output order,
    when the engine is done; the last event carries the whole response."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.sequence = 0
        self.message: _StreamedItem | None = None
        self.calls: dict[int, _StreamedItem] = {}
        self.items: list[_StreamedItem] = []
        self.finish_reason: str | None = None
        self.usage: ResponseUsage | None = None

    def _next(self) -> int:
        number = self.sequence
        self.sequence += 1
        return number

    def start(self) -> list[ResponseStreamEvent]:
        response = self.shape.response("in_progress", [])
        return [
            ResponseCreatedEvent(response, self._next()),
            ResponseInProgressEvent(response, self._next()),
        ]

    def feed(self, chunk: ChatCompletionChunk) -> list[ResponseStreamEvent]:
        events: list[ResponseStreamEvent] = []
        if isinstance(chunk.usage, Usage):
            self.usage = response_usage(chunk.usage)
        for choice in chunk.choices:
            if choice.index != 0:
                continue
            delta = choice.delta
            if isinstance(delta.content, str) and delta.content:
                events.extend(self._text(delta.content, _entries(choice.logprobs)))
            if isinstance(delta.refusal, str) and delta.refusal:
                events.extend(self._refusal(delta.refusal))
            for call in delta.tool_calls or []:
                events.extend(self._call(call.index, call.id, call.function))
            if choice.finish_reason is not None:
                self.finish_reason = choice.finish_reason
        return events

    def _open_part(self, kind: PartKind) -> tuple[_StreamedItem, int, list[ResponseStreamEvent]]:
        """The message (opened with its first part) and the index of its part of this kind (opened if new)."""
        events: list[ResponseStreamEvent] = []
        item = self.message
        if item is None:
            item = self.message = _StreamedItem(len(self.items), message_item_id(self.shape.call_id))
            self.items.append(item)
            added = ResponseOutputMessage(id=item.item_id, content=[], status="in_progress")
            events.append(ResponseOutputItemAddedEvent(item.output_index, self._next(), added))
        if kind in item.parts:
            return item, item.parts.index(kind), events
        item.parts.append(kind)
        index = len(item.parts) - 1
        part = ResponseOutputText("", [], []) if kind == "text" else ResponseRefusal("")
        events.append(
            ResponseContentPartAddedEvent(item.item_id, item.output_index, index, part, self._next())
        )
        return item, index, events

    def _text(self, text: str, entries: list[TokenLogprob]) -> list[ResponseStreamEvent]:
        item, index, events = self._open_part("text")
        item.text.append(text)
        if self.shape.logprobs:
            item.logprobs.extend(_logprobs(entries))
        delta_logprobs = _delta_logprobs(entries) if self.shape.logprobs else []
        events.append(
            ResponseTextDeltaEvent(item.item_id, item.output_index, index, text, self._next(), delta_logprobs)
        )
        return events

    def _refusal(self, text: str) -> list[ResponseStreamEvent]:
        item, index, events = self._open_part("refusal")
        item.refusal.append(text)
        events.append(ResponseRefusalDeltaEvent(item.item_id, item.output_index, index, text, self._next()))
        return events

    def _call(self, index: int, tool_call_id: Any, function: Any) -> list[ResponseStreamEvent]:
        events: list[ResponseStreamEvent] = []
        item = self.calls.get(index)
        name = function.name if function is not UNSET and isinstance(function.name, str) else ""
        arguments = (
            function.arguments if function is not UNSET and isinstance(function.arguments, str) else ""
        )
        if item is None:
            position = len(self.calls)
            item = _StreamedItem(
                len(self.items),
                function_call_item_id(self.shape.call_id, position),
                call_id=tool_call_id
                if isinstance(tool_call_id, str)
                else f"call_{self.shape.call_id}_{position}",
                name=name,
            )
            self.calls[index] = item
            self.items.append(item)
            added = ResponseFunctionCall(
                id=item.item_id, call_id=item.call_id, name=item.name, arguments="", status="in_progress"
            )
            events.append(ResponseOutputItemAddedEvent(item.output_index, self._next(), added))
        elif name and not item.name:
            item.name = name
        if arguments:
            item.arguments.append(arguments)
            events.append(
                ResponseFunctionCallArgumentsDeltaEvent(
                    item.item_id, item.output_index, self._next(), arguments
                )
            )
        return events

    def _output(self, status: ResponseStatus) -> list[OutputItem]:
        item_status: ItemStatus = "incomplete" if status != "completed" else "completed"
        output: list[OutputItem] = []
        for item in self.items:
            if item.is_message:
                output.append(
                    ResponseOutputMessage(id=item.item_id, content=item.content(), status=item_status)
                )
            else:
                output.append(
                    ResponseFunctionCall(
                        id=item.item_id,
                        call_id=item.call_id,
                        name=item.name,
                        arguments="".join(item.arguments),
                        status="completed" if status != "failed" else "incomplete",
                    )
                )
        return output

    def finish(self) -> tuple[list[ResponseStreamEvent], Response]:
        """The closing events and the terminal one (`response.completed` or `response.incomplete`)."""
        events: list[ResponseStreamEvent] = []
        if not self.items:  # an empty reply is an empty message, as in a non-streamed response
            events.extend(self._open_part("text")[2])
        response = self.shape.finished([], self.finish_reason, self.usage)
        response.output = self._output(response.status)
        for item, done in zip(self.items, response.output, strict=True):
            if isinstance(done, ResponseOutputMessage):
                for index, part in enumerate(done.content):
                    events.append(self._part_done(item, index, part))
                    events.append(
                        ResponseContentPartDoneEvent(
                            item.item_id, item.output_index, index, self._next(), part
                        )
                    )
            else:
                assert isinstance(done, ResponseFunctionCall)
                events.append(
                    ResponseFunctionCallArgumentsDoneEvent(
                        item.item_id, done.name, item.output_index, self._next(), done.arguments
                    )
                )
            events.append(ResponseOutputItemDoneEvent(item.output_index, self._next(), done))
        if response.status == "incomplete":
            events.append(ResponseIncompleteEvent(response, self._next()))
        else:
            events.append(ResponseCompletedEvent(response, self._next()))
        return events, response

    def _part_done(
        self, item: _StreamedItem, index: int, part: ResponseOutputText | ResponseRefusal
    ) -> ResponseStreamEvent:
        if isinstance(part, ResponseRefusal):
            return ResponseRefusalDoneEvent(
                item.item_id, item.output_index, index, part.refusal, self._next()
            )
        delta_logprobs = [
            ResponseLogProb(
                e.token, e.logprob, [ResponseTopLogprob(t.token, t.logprob) for t in e.top_logprobs]
            )
            for e in part.logprobs
        ]
        return ResponseTextDoneEvent(
            item.item_id, item.output_index, index, part.text, self._next(), delta_logprobs
        )

    def fail(self, message: str) -> ResponseStreamEvent:
        """`response.failed`, with what the engine produced before it failed."""
        response = self.shape.response(
            "failed", self._output("failed"), usage=self.usage, error=ResponseError("server_error", message)
        )
        return ResponseFailedEvent(self._next(), response)
