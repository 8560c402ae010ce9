"""A stream's chunks go to the client in batches of those that arrived together, and never wait for more."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from gateway.chat import LastBatch, LastEvent, event_chunks, sse
from gateway.engines.base import EngineStream
from gateway.errors import APIError


class Reads(EngineStream):
    """An engine stream whose chunks arrive in reads, the stream's end with the last (unless it fails). Before
    each read after the first it waits (for the engine, as a real stream would) and notes how many chunks the
    consumer has by then, as `received` counts them."""

    def __init__(self, reads: list[list[Any]], error: APIError | None = None) -> None:
        self.reads = reads
        self.error = error
        self.received: list[Any] = []
        self.at_waits: list[int] = []
        self.left = 0
        self.in_last = False
        self.closed = False

    def ready(self) -> bool:
        return self.left > 0 or (self.in_last and self.error is None)

    async def __aiter__(self) -> AsyncIterator[Any]:
        for number, read in enumerate(self.reads):
            if number:
                await asyncio.sleep(0)
                self.at_waits.append(len(self.received))
            self.in_last = number == len(self.reads) - 1
            for index, chunk in enumerate(read):
                self.left = len(read) - index - 1
                yield chunk
        if self.error is not None:
            raise self.error

    async def close(self) -> None:
        self.closed = True


class Chunk(msgspec.Struct):
    n: int


class Assembler:
    """Passes chunks through as they are; a chunk of None is one the relay sends nothing for."""

    output_seen = False

    def feed(self, raw: Any) -> msgspec.Struct | None:
        self.output_seen = self.output_seen or raw is not None
        return None if raw is None else Chunk(raw)


def test_chunks_that_arrived_together_are_one_batch_and_none_waits_for_the_next_read() -> None:
    finished: list[str] = []
    engine = Reads([[1, 2, 3], [4, None], [None], [5]])

    async def main() -> list[list[Any]]:
        batches = event_chunks(engine, Assembler(), 0.0, lambda status, *_: finished.append(status))
        seen = []
        async for batch in batches:
            seen.append(batch)
            engine.received.extend(batch)
        return seen

    seen = asyncio.run(asyncio.wait_for(main(), 10))
    assert seen == [[Chunk(1), Chunk(2), Chunk(3)], [Chunk(4)], [Chunk(5)]]
    # Whenever the engine stream had to wait, the consumer had every chunk sent before: none was held back.
    assert engine.at_waits == [3, 4, 4]
    # The last chunks come once the call is recorded, so the relay can send them with the stream's end.
    assert [type(batch) is LastBatch for batch in seen] == [False, False, True]
    assert engine.closed
    assert finished == ["ok"]


def test_the_events_of_a_batch_are_one_write_and_the_last_go_with_the_end() -> None:
    async def main() -> list[bytes]:
        engine = Reads([[1, 2], [3]])
        chunks = event_chunks(engine, Assembler(), 0.0, lambda *_: None)
        sent = []
        async for event in sse(chunks):
            sent.append(event)
        return sent

    sent = asyncio.run(asyncio.wait_for(main(), 10))
    assert sent == [b'data: {"n":1}\n\ndata: {"n":2}\n\n', b'data: {"n":3}\n\ndata: [DONE]\n\n']
    assert [type(event) is LastEvent for event in sent] == [False, True]


def test_an_engine_failure_mid_stream_ends_it_with_the_error_as_last_event() -> None:
    failure = APIError("the engine went away", code="engine_disconnected")

    async def main() -> list[bytes]:
        engine = Reads([[1]], error=failure)
        chunks = event_chunks(engine, Assembler(), 0.0, lambda *_: None)
        return [event async for event in sse(chunks)]

    sent = asyncio.run(asyncio.wait_for(main(), 10))
    assert sent[0] == b'data: {"n":1}\n\n'
    assert type(sent[-1]) is LastEvent
    assert "the engine went away" in sent[-1].decode()
    assert len(sent) == 2
