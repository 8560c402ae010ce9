"""Run the real gateway app under uvicorn on a loopback port, in a background thread, for integration tests."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import httpx
import uvicorn

from gateway.app import Services, build_services, create_app
from gateway.http_protocol import http_protocol
from gateway.settings import Settings
from migrations.runner import upgrade_database
from tests.support.ports import free_port

T = TypeVar("T")


class GatewayServer:
    """The gateway exactly as `kaizen serve` runs it, minus the process boundary (so tests can inspect it)."""

    def __init__(
        self,
        settings: Settings,
        services: Services | None = None,
        startup_timeout_s: float = 30,
        http: type[asyncio.Protocol] | None = None,
    ) -> None:
        self.startup_timeout_s = startup_timeout_s
        self.port = settings.port or free_port()
        self.settings = settings.model_copy(update={"port": self.port})
        # uvicorn's HTTP protocol class (its parser): by default the one `kaizen serve` runs, with its timeouts.
        self.http = http or http_protocol(self.settings)
        self.services = services or build_services(self.settings)
        self.app = create_app(self.services)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> GatewayServer:
        asyncio.run(upgrade_database(self.settings.database_url))
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.port,
            loop="asyncio",
            http=self.http,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=10,
        )
        self._server = uvicorn.Server(config)

        def run() -> None:
            assert self._server is not None
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self._server.serve())

        self._thread = threading.Thread(target=run, name="gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if not self._thread.is_alive():
                raise RuntimeError("the gateway exited during start-up (see the log above)")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        # Stop what the start-up began before giving up on it: a vLLM server lives in its own session and
        # would outlive the test run.
        if self.loop is not None:
            self.call(self.services.engine.close(), timeout_s=60)
        self.stop()
        raise TimeoutError("gateway did not start")

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
        """Run a coroutine on the gateway's own event loop (e.g. to flush the capture queue)."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def flush(self) -> None:
        self.call(self.services.sink.flush())

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
