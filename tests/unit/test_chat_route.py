"""The bare ASGI chat route's own parts: reading the body, and relaying a stream to a client that may leave."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from gateway.chat import LastEvent
from gateway.controllers.chat import ClientDisconnected, EventStream, read_body
from gateway.errors import PayloadTooLarge

Message = dict[str, Any]


def receiving(*messages: Message) -> Any:
    """An ASGI `receive` that hands out `messages`, then waits for good (a client that is still there)."""
    queue: asyncio.Queue[Message] = asyncio.Queue()
    for message in messages:
        queue.put_nowait(message)
    return queue.get


def test_a_body_sent_in_pieces_is_read_whole() -> None:
    pieces = [
        {"type": "http.request", "body": b'{"a":', "more_body": True},
        {"type": "http.request", "body": b"1}"},
    ]
    assert asyncio.run(read_body(receiving(*pieces), None, 100)) == b'{"a":1}'


def test_a_body_past_the_limit_is_refused_declared_or_not() -> None:
    # Declared too large: refused before a byte is read (nothing would answer `receive` here).
    with pytest.raises(PayloadTooLarge):
        asyncio.run(read_body(receiving(), "101", 100))
    # Sent in pieces without a length: refused once the pieces pass the limit.
    pieces = [{"type": "http.request", "body": b"x" * 60, "more_body": True}] * 2
    with pytest.raises(PayloadTooLarge):
        asyncio.run(read_body(receiving(*pieces), None, 100))
    assert asyncio.run(read_body(receiving({"type": "http.request", "body": b"x" * 100}), "100", 100))


def test_a_client_that_leaves_while_sending_is_a_disconnect() -> None:
    pieces = [{"type": "http.request", "body": b"{", "more_body": True}, {"type": "http.disconnect"}]
    with pytest.raises(ClientDisconnected):
        asyncio.run(read_body(receiving(*pieces), None, 100))


class Events:
    """An event source that records whether it was closed, as the chat service's relay records the call."""

    def __init__(self, count: int, pause_s: float = 0.0) -> None:
        self.count = count
        self.pause_s = pause_s
        self.closed = asyncio.Event()

    async def __call__(self) -> AsyncGenerator[bytes, None]:
        try:
            for index in range(self.count):
                if index:
                    await asyncio.sleep(self.pause_s)
                yield b"data: %d\n\n" % index
        finally:
            self.closed.set()


def test_a_stream_is_sent_whole_then_ended() -> None:
    async def run() -> list[Message]:
        events = Events(3)
        sent: list[Message] = []

        async def send(message: Message) -> None:
            sent.append(message)

        await EventStream(events(), {"x-request-id": "r1"})({}, receiving(), send)  # type: ignore[arg-type]
        assert events.closed.is_set()
        return sent

    sent = asyncio.run(run())
    start, *body = sent
    assert start["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in start["headers"]
    assert (b"x-request-id", b"r1") in start["headers"]
    assert [m["body"] for m in body] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]
    assert [m["more_body"] for m in body] == [True, True, True, False]


def test_a_streams_last_event_goes_out_with_the_end_of_the_body() -> None:
    async def run() -> list[Message]:
        async def events() -> AsyncGenerator[bytes, None]:
            yield b"data: 0\n\ndata: 1\n\n"
            yield LastEvent(b"data: [DONE]\n\n")

        sent: list[Message] = []

        async def send(message: Message) -> None:
            sent.append(message)

        await EventStream(events(), {})({}, receiving(), send)  # type: ignore[arg-type]
        return sent

    _, *body = asyncio.run(run())
    assert [(m["body"], m["more_body"]) for m in body] == [
        (b"data: 0\n\ndata: 1\n\n", True),
        (b"data: [DONE]\n\n", False),
    ]


def test_a_client_that_leaves_mid_stream_stops_the_relay_and_closes_the_events() -> None:
    async def run() -> list[Message]:
        events = Events(1000, pause_s=0.01)
        sent: list[Message] = []
        left = asyncio.Event()

        async def receive() -> Message:
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            sent.append(message)
            if len(sent) == 3:  # the head and two events went out: the client leaves
                left.set()

        await asyncio.wait_for(EventStream(events(), {})({}, receive, send), 10)  # type: ignore[arg-type]
        assert events.closed.is_set()
        return sent

    sent = asyncio.run(run())
    assert 3 <= len(sent) < 10
    assert all(m.get("more_body", True) for m in sent[1:])  # never ended as if complete
