"""A layer-4 load balancer on a loopback port, standing in for the one in front of gateway replicas.

Each accepted connection goes to the next backend in the rotation (round robin) and its bytes are copied both
ways until both sides are done. `drain` takes a backend out of the rotation and waits until the connections it
holds have ended, as a load balancer's connection draining (deregistration delay) does before the backend is
stopped. A backend that refuses or breaks a connection makes that call fail: the client sees it, unless
`failover` is set: then a refused connection goes to the next backend, as a balancer with health checks takes a
dead replica out of the rotation (a connection broken mid-call still fails).
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

from tests.support.polling import wait_until_async

_CHUNK = 65536


@dataclass
class Backend:
    name: str
    port: int
    active: int = 0  # connections open now
    served: int = 0  # connections ended
    refused: int = 0  # connections the backend did not accept


@dataclass
class TcpBalancer:
    rotation: list[Backend] = field(default_factory=list)
    failover: bool = False
    _server: asyncio.Server | None = None
    _turn: itertools.count[int] = field(default_factory=itertools.count)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> TcpBalancer:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self

    def add(self, name: str, port: int) -> Backend:
        backend = Backend(name, port)
        self.rotation.append(backend)
        return backend

    async def drain(self, backend: Backend, timeout_s: float = 60) -> None:
        """No new connections to `backend`; returns once its open ones have ended."""
        self.rotation.remove(backend)

        async def idle() -> bool:
            return backend.active == 0

        await wait_until_async(
            idle, f"{backend.name}'s connections to end", timeout_s=timeout_s, every_s=0.01
        )

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.create_task(self._relay(client_reader, client_writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        if not self.rotation:
            client_writer.close()
            return
        tries = len(self.rotation) if self.failover else 1
        for attempt in range(tries):
            backend = self.rotation[next(self._turn) % len(self.rotation)]
            try:
                backend_reader, backend_writer = await asyncio.open_connection("127.0.0.1", backend.port)
                break
            except OSError:
                backend.refused += 1
                if attempt == tries - 1:
                    client_writer.close()
                    return
        backend.active += 1
        try:
            try:
                await asyncio.gather(
                    _copy(client_reader, backend_writer), _copy(backend_reader, client_writer)
                )
            finally:
                backend_writer.close()
        finally:
            backend.active -= 1
            backend.served += 1
            client_writer.close()


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until end of stream, then pass the end on (a half-close); a reset ends the copy (the client sees it)."""
    try:
        while chunk := await reader.read(_CHUNK):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        writer.close()
