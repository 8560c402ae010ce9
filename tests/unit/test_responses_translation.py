"""The Responses API translation, by hand: input items into chat messages, tools and formats into their chat
fields, chat replies and chunks into a `Response` and its event sequence (each checked against OpenAI's schema)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from gateway.errors import InvalidRequest
from gateway.normalize import Captured
from gateway.protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    ChunkChoice,
    Delta,
    ToolCallChunk,
    ToolCallChunkFunction,
    Usage,
)
from gateway.responses.output import (
    ResponseEvents,
    ResponseShape,
    call_id_of,
    from_captured,
    from_completion,
    to_builtins,
)
from gateway.responses.request import (
    chat_body,
    extra_fields,
    parse_items,
    parse_request,
    to_messages,
    translate_tools,
)
from tests.support.openai_schema import validate

CALL = "0" * 31 + "1"
TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


def translate(body: dict[str, Any]) -> dict[str, Any]:
    request = parse_request(body)
    messages = to_messages(request.instructions, [], parse_items(request.input), {})
    return chat_body(request, messages, translate_tools(request), extra_fields(body))


def test_output_items_sent_back_become_the_assistant_turn_the_engine_wrote() -> None:
    body = translate(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": "weather?"},
                {
                    "type": "message",
                    "role": "assistant",
                    "id": "msg_1",
                    "status": "completed",
                    "content": [
                        {"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}
                    ],
                },
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "get_weather",
                    "arguments": '{"city":"Oslo"}',
                },
                {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "snow"},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {
                    "type": "function_call_output",
                    "call_id": "c2",
                    "output": [{"type": "input_text", "text": "?"}],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "and"},
                        {"type": "input_image", "image_url": "data:image/png;base64,AA", "detail": "low"},
                    ],
                },
            ],
        }
    )
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                },
                {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "snow"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "?"}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "and"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA", "detail": "low"}},
            ],
        },
    ]


def test_parameters_map_onto_chat_and_extras_pass() -> None:
    body = translate(
        {
            "model": "m",
            "input": "hi",
            "tools": [TOOL, {**TOOL, "name": "b", "strict": True, "description": "B"}],
            "tool_choice": {"type": "function", "name": "b"},
            "parallel_tool_calls": False,
            "text": {
                "format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}
            },
            "max_output_tokens": 50,
            "include": ["message.output_text.logprobs", "reasoning.encrypted_content"],
            "top_logprobs": 3,
            "stream": True,
            "store": False,
            "reasoning": {"effort": "high"},
            "top_k": 4,
        }
    )
    assert body == {
        "top_k": 4,
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [
            {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
            {
                "type": "function",
                "function": {
                    "name": "b",
                    "description": "B",
                    "parameters": {"type": "object"},
                    "strict": True,
                },
            },
        ],
        "parallel_tool_calls": False,
        "tool_choice": {"type": "function", "function": {"name": "b"}},
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True},
        },
        "max_completion_tokens": 50,
        "logprobs": True,
        "top_logprobs": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "input": [{"type": "computer_call"}]}, "input[0].type"),
        (
            {"model": "m", "input": [{"role": "assistant", "content": [{"type": "input_image"}]}]},
            "input[0].content[0]",
        ),
        ({"model": "m", "input": "x", "tools": [{"type": "mcp"}]}, "tools[0].type"),
        ({"model": "m", "input": "x", "conversation": "conv_1"}, "conversation"),
        ({"model": "m", "input": "x", "n": 2}, "n"),
        (
            {
                "model": "m",
                "input": [
                    {"type": "reasoning", "id": "rs_1", "summary": []},
                    {"role": "user", "content": [{"type": "input_image", "file_id": "f"}]},
                ],
            },
            "input[1].content[0].image_url",
        ),
    ],
)
def test_what_has_no_chat_equivalent_is_refused_by_name(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        translate(body)
    assert refused.value.param == param


def test_ids_lead_back_to_their_call() -> None:
    assert call_id_of(f"resp_{CALL}") == call_id_of(f"msg_{CALL}") == call_id_of(f"fc_{CALL}_12") == CALL
    assert call_id_of("fc_x") is None and call_id_of("item_1") is None and call_id_of("resp_") is None


def chunk(
    *, content: str | None = None, calls: list[ToolCallChunk] | None = None, finish: Any = None
) -> ChatCompletionChunk:
    delta = Delta()
    if content is not None:
        delta.content = content
    if calls is not None:
        delta.tool_calls = calls
    return ChatCompletionChunk("c", 0, "m", [ChunkChoice(0, delta, finish)])


def test_a_streamed_reply_becomes_the_event_sequence() -> None:
    shape = ResponseShape(
        CALL, 1, parse_request({"model": "m", "input": "x", "tools": [TOOL]}), [], logprobs=False
    )
    shape.tools = translate_tools(shape.request).tools
    stream = ResponseEvents(shape)
    events = stream.start()
    events += stream.feed(chunk(content="Let me "))
    events += stream.feed(chunk(content="see."))
    first = ToolCallChunk(
        0, id="call_a", type="function", function=ToolCallChunkFunction("get_weather", '{"ci')
    )
    events += stream.feed(chunk(calls=[first]))
    second = ToolCallChunk(
        1, id="call_b", type="function", function=ToolCallChunkFunction("get_weather", "{}")
    )
    events += stream.feed(chunk(calls=[second]))
    events += stream.feed(chunk(calls=[ToolCallChunk(0, function=ToolCallChunkFunction(arguments='ty":1}'))]))
    events += stream.feed(chunk(finish="tool_calls"))
    usage_chunk = ChatCompletionChunk("c", 0, "m", [])
    usage_chunk.usage = Usage(5, 7, 12)
    events += stream.feed(usage_chunk)
    closing, final = stream.finish()
    events += closing
    encoded = [msgspec.to_builtins(e) for e in events]
    for event in encoded:
        validate("ResponseStreamEvent", event)
    assert [(e["type"], e.get("output_index")) for e in encoded] == [
        ("response.created", None),
        ("response.in_progress", None),
        ("response.output_item.added", 0),
        ("response.content_part.added", 0),
        ("response.output_text.delta", 0),
        ("response.output_text.delta", 0),
        ("response.output_item.added", 1),
        ("response.function_call_arguments.delta", 1),
        ("response.output_item.added", 2),
        ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.delta", 1),  # engines may interleave; the item id keeps them apart
        ("response.output_text.done", 0),
        ("response.content_part.done", 0),
        ("response.output_item.done", 0),
        ("response.function_call_arguments.done", 1),
        ("response.output_item.done", 1),
        ("response.function_call_arguments.done", 2),
        ("response.output_item.done", 2),
        ("response.completed", None),
    ]
    assert [e["sequence_number"] for e in encoded] == list(range(len(encoded)))
    body = to_builtins(final)
    validate("Response", body)
    assert [(i["id"], i["type"]) for i in body["output"]] == [
        (f"msg_{CALL}", "message"),
        (f"fc_{CALL}_0", "function_call"),
        (f"fc_{CALL}_1", "function_call"),
    ]
    assert body["output"][0]["content"][0]["text"] == "Let me see."
    assert (body["output"][1]["call_id"], body["output"][1]["arguments"]) == ("call_a", '{"city":1}')
    assert body["usage"] == {
        "input_tokens": 5,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": 7,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 12,
    }


def test_a_streamed_refusal_is_a_part_of_its_own() -> None:
    """Refusal deltas open a `refusal` part beside any text, numbered by the order the parts opened."""
    stream = ResponseEvents(
        ResponseShape(CALL, 1, parse_request({"model": "m", "input": "x"}), [], logprobs=False)
    )
    events = stream.start()
    events += stream.feed(chunk(content="Well,"))
    refusal = Delta()
    refusal.refusal = "I can't."
    events += stream.feed(ChatCompletionChunk("c", 0, "m", [ChunkChoice(0, refusal, "stop")]))
    closing, final = stream.finish()
    encoded = [msgspec.to_builtins(e) for e in [*events, *closing]]
    for event in encoded:
        validate("ResponseStreamEvent", event)
    assert [(e["type"], e.get("content_index")) for e in encoded[2:]] == [
        ("response.output_item.added", None),
        ("response.content_part.added", 0),
        ("response.output_text.delta", 0),
        ("response.content_part.added", 1),
        ("response.refusal.delta", 1),
        ("response.output_text.done", 0),
        ("response.content_part.done", 0),
        ("response.refusal.done", 1),
        ("response.content_part.done", 1),
        ("response.output_item.done", None),
        ("response.completed", None),
    ]
    assert encoded[-4]["refusal"] == "I can't."
    body = to_builtins(final)
    validate("Response", body)
    assert [p["type"] for p in body["output"][0]["content"]] == ["output_text", "refusal"]


def test_a_reply_cut_at_the_limit_is_incomplete_and_a_failure_is_failed() -> None:
    shape = ResponseShape(CALL, 1, parse_request({"model": "m", "input": "x"}), [], logprobs=False)
    stream = ResponseEvents(shape)
    stream.start()
    stream.feed(chunk(content="w0 w1", finish="length"))
    closing, final = stream.finish()
    assert closing[-1].response.status == "incomplete"  # type: ignore[union-attr]
    body = to_builtins(final)
    validate("Response", body)
    assert body["incomplete_details"] == {"reason": "max_output_tokens"} and body["completed_at"] is None
    assert body["output"][0]["status"] == "incomplete"

    broken = ResponseEvents(
        ResponseShape(CALL, 1, parse_request({"model": "m", "input": "x"}), [], logprobs=False)
    )
    broken.start()
    broken.feed(chunk(content="partial"))
    failed = msgspec.to_builtins(broken.fail("the engine went away"))
    validate("ResponseStreamEvent", failed)
    assert failed["response"]["error"] == {"code": "server_error", "message": "the engine went away"}


def test_an_engine_that_answers_no_choice_gives_an_empty_message() -> None:
    shape = ResponseShape(CALL, 1, parse_request({"model": "m", "input": "x"}), [], logprobs=False)
    empty = ChatCompletion("c", 0, "m", [])
    for response in (from_completion(shape, empty), from_captured(shape, Captured(response={"choices": []}))):
        body = to_builtins(response)
        validate("Response", body)
        assert body["status"] == "completed" and body["output"][0]["content"][0]["text"] == ""
