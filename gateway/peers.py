"""The serving workers of one `kaizen serve` asking each other what only one of them knows (`gateway.workers`).

Each worker answers on a Unix socket of its own, in the parent's private directory: a question is one line, a
topic and a JSON argument; the answer is the bytes up to the end of the connection. What is asked: a worker's
metrics exposition (`/metrics` covers all of them), and whether an episode has turns in its capture queue (an
episode is not served half written, whichever worker answered its turns).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec

log = logging.getLogger(__name__)

#: How long a question waits for a sibling's answer (one that is restarting is left out).
PEER_TIMEOUT_S = 2.0

Answer = Callable[[str], bytes]


@dataclass(frozen=True)
class WorkerPeers:
    """This worker's index, every worker's socket, and the parent that made their directory."""

    index: int
    sockets: tuple[Path, ...]
    parent: int  # its process id


class PeerLink:
    """Answers the siblings' questions with the handlers registered for their topics, and asks them."""

    def __init__(self, peers: WorkerPeers) -> None:
        self.peers = peers
        self._answers: dict[str, Answer] = {}
        self._server: asyncio.Server | None = None

    def answer(self, topic: str, handler: Answer) -> None:
        """Answer `topic` with `handler(argument)` (called on the event loop: it must not block)."""
        self._answers[topic] = handler

    async def start(self) -> None:
        path = self.peers.sockets[self.peers.index]
        path.unlink(missing_ok=True)  # left by the worker this one replaces
        self._server = await asyncio.start_unix_server(self._serve, path=str(path))

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        own = self.peers.sockets[self.peers.index]
        own.unlink(missing_ok=True)
        if os.getppid() != self.peers.parent:
            # A SIGKILLed parent never removes the directory: the last worker out does (refused while a sibling's
            # socket is still in it).
            with contextlib.suppress(OSError):
                own.parent.rmdir()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            topic, _, argument = (await reader.readline()).rstrip(b"\n").partition(b" ")
            handler = self._answers.get(topic.decode(errors="replace"))
            if handler is None:
                log.warning("a sibling worker asked about %r, which this worker does not answer", topic)
            else:
                writer.write(handler(msgspec.json.decode(argument, type=str)))
                await writer.drain()
        finally:
            writer.close()

    async def ask(self, topic: str, argument: str = "") -> dict[int, bytes]:
        """Every other worker's answer, by index; one that does not answer in time is left out (logged)."""
        others = [(i, p) for i, p in enumerate(self.peers.sockets) if i != self.peers.index]
        question = topic.encode() + b" " + msgspec.json.encode(argument) + b"\n"
        answers = await asyncio.gather(
            *(asyncio.wait_for(self._ask_one(path, question), PEER_TIMEOUT_S) for _, path in others),
            return_exceptions=True,
        )
        found: dict[int, bytes] = {}
        for (index, _), answer in zip(others, answers, strict=True):
            if isinstance(answer, BaseException):
                log.warning("worker %d did not answer about %s (%s); left out", index, topic, answer)
            else:
                found[index] = answer
        return found

    @staticmethod
    async def _ask_one(path: Path, question: bytes) -> bytes:
        reader, writer = await asyncio.open_unix_connection(str(path))
        try:
            writer.write(question)
            await writer.drain()
            return await reader.read()
        finally:
            writer.close()
