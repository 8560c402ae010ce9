"""The JSON answers sent over bare ASGI: the exact messages, headers in the order clients have always got them."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.bare_asgi import send_json
from gateway.controllers.chat import JSONReply
from gateway.errors import EngineUnavailable


def sent(answer: Any) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    asyncio.run(answer(send))
    return messages


def test_a_json_answer_is_its_head_then_its_whole_body() -> None:
    assert sent(
        lambda send: send_json(send, 415, b'{"error":{}}', [(b"x-a", b"1")], leading=[(b"x-b", b"2")])
    ) == [
        {
            "type": "http.response.start",
            "status": 415,
            "headers": [
                (b"x-b", b"2"),
                (b"content-type", b"application/json"),
                (b"content-length", b"12"),
                (b"x-a", b"1"),
            ],
        },
        {"type": "http.response.body", "body": b'{"error":{}}', "more_body": False},
    ]


def test_an_errors_own_headers_lead_and_a_replys_follow() -> None:
    error = EngineUnavailable(retry_after=2.0)
    error.headers["x-request-id"] = "r1"
    [start, _] = sent(error.send)
    assert [name for name, _ in start["headers"]] == [
        b"x-request-id",
        b"retry-after",
        b"content-type",
        b"content-length",
    ]
    [start, body] = sent(lambda send: JSONReply(b"{}", {"x-request-id": "r1"})({}, None, send))  # type: ignore[arg-type]
    assert start["headers"] == [
        (b"content-type", b"application/json"),
        (b"content-length", b"2"),
        (b"x-request-id", b"r1"),
    ]
    assert body == {"type": "http.response.body", "body": b"{}", "more_body": False}
