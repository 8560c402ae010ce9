"""An aiohttp application served on a loopback port by a thread with its own event loop, for tests."""

from __future__ import annotations

import asyncio
import socket
import threading

from aiohttp import web


class BackgroundServer:
    """Binds at `start` (port 0: a free one, returned) and serves until `stop`."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, name: str) -> None:
        self.runner = runner
        self.host = host
        self.port = port
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        if self._thread is not None:
            raise RuntimeError("already started")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        loop = asyncio.new_event_loop()
        loop.run_until_complete(self.runner.setup())
        loop.run_until_complete(web.SockSite(self.runner, sock).start())
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name=f"{self.name}-{self.port}", daemon=True)
        self._thread.start()
        return self.port

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        self._loop = self._thread = None
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
