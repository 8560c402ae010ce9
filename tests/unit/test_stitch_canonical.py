"""Stitching compares conversations by what they say, not by how a client serialised them."""

from __future__ import annotations

from typing import Any

from gateway.episodes import ConversationHashes

USER = {"role": "user", "content": "weather in Paris?"}


def _reply(arguments: str, content: Any = None) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        ],
    }


def _key(reply: dict[str, Any]) -> str:
    """What the first call registers for `reply`."""
    return ConversationHashes.of([USER]).continuation(reply)


def _lookup(*messages: dict[str, Any]) -> list[str]:
    """What a follow-up call sending `messages` looks for."""
    return ConversationHashes.of([USER, *messages]).lookup


def test_arguments_compare_as_json_values() -> None:
    served = _key(_reply('{"city": "Paris", "unit": "c"}'))
    for resent in (
        '{"city":"Paris","unit":"c"}',  # the AI SDK's JSON.stringify
        '{"unit": "c", "city": "Paris"}',  # another key order
        '{\n  "city": "Paris",\n  "unit": "c"\n}',  # pretty-printed
        '{"city": "\\u0050aris", "unit": "c"}',  # unicode escapes
    ):
        tool = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
        assert _lookup(_reply(resent), tool)[0] == served, resent


def test_different_arguments_do_not_stitch() -> None:
    served = _key(_reply('{"city": "Paris"}'))
    assert _lookup(_reply('{"city": "London"}'))[0] != served
    assert _lookup(_reply('{"city": "Paris", "unit": "c"}'))[0] != served
    assert _lookup(_reply('{"city": ["Paris"]}'))[0] != served


def test_arguments_that_are_not_json_compare_as_text() -> None:
    served = _key(_reply("{city: Paris"))
    assert _lookup(_reply("{city: Paris"))[0] == served
    assert _lookup(_reply("{city:Paris"))[0] != served


def test_content_as_a_string_or_as_text_parts() -> None:
    served = _key({"role": "assistant", "content": "It is sunny."})
    as_parts = {"role": "assistant", "content": [{"type": "text", "text": "It is sunny."}]}
    with_cache_control = {
        "role": "assistant",
        "content": [{"type": "text", "text": "It is sunny.", "cache_control": {"type": "ephemeral"}}],
    }
    assert _lookup(as_parts)[0] == served
    assert _lookup(with_cache_control)[0] == served
    assert _lookup({"role": "assistant", "content": "It is rainy."})[0] != served


def test_json_content_compares_by_value() -> None:
    served = _key({"role": "assistant", "content": '{"answer": 5, "unit": "none"}'})
    assert _lookup({"role": "assistant", "content": '{"unit":"none","answer":5}'})[0] == served
    assert _lookup({"role": "assistant", "content": '{"answer": 6, "unit": "none"}'})[0] != served


def test_null_and_empty_content_beside_tool_calls_are_alike() -> None:
    served = _key(_reply('{"city": "Paris"}', content=None))
    assert _lookup(_reply('{"city":"Paris"}', content=""))[0] == served


def test_plain_text_conversations_hash_as_before() -> None:
    """Text-only conversations keep their hashes, so stored stitch keys and context hashes stay valid."""
    hashes = ConversationHashes.of([{"role": "system", "content": "be brief"}, USER])
    assert hashes.context_hash == "b0b1d6f28288ede98ae24547687a58ce"
