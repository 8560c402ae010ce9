"""`kaizen serve` with several serving processes on one port around one engine, supervised.

One Python process serves on one core (docs/performance.md#serving-workers); workers use more. The parent
(`Supervisor`) binds the port once and hands the listening socket to every worker, which accepts from it, so a
busy worker simply accepts less. The parent owns what must exist once: the vLLM server(s) it starts (the workers
attach to them by URL, so one engine serves all of them and starts once; it also learns the adapters they load,
to re-load them after restarting a dead server) and the workers themselves. Each worker is an ordinary gateway
(`gateway.app`) with its own capture directory and writer (`gateway.capture.directory`): when a worker dies the
parent starts another, which claims the free directory and stores what was logged there before it serves. Only
worker 0 runs the schedules; `/metrics`, whichever worker answers it, covers all of them (`gateway.metrics`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from gateway.engines.base import Engine
from gateway.settings import Settings
from trainer.control.child_processes import dying_with_parent, own_modules_environment

log = logging.getLogger(__name__)

#: A worker that exits sooner than this after it started failed to start.
QUICK_EXIT_S = 15.0
#: Failed starts in a row after which the parent gives up: the settings or the machine are wrong.
MAX_QUICK_EXITS = 5
#: What the workers get to finish their calls and store their capture after SIGTERM (uvicorn's 30 s, then the
#: capture writer's drain), before they are killed.
STOP_TIMEOUT_S = 60.0


class WorkerConfig(msgspec.Struct, frozen=True):
    """What a worker reads from its stdin: the parent's settings as it should use them, and its place."""

    index: int
    count: int
    listen_fd: int
    peer_dir: str
    settings: dict[str, Any]


def peer_sockets(peer_dir: Path, count: int) -> tuple[Path, ...]:
    return tuple(peer_dir / f"{index}.sock" for index in range(count))


def listening_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """One listening socket per worker, all on the same port (`SO_REUSEPORT`; IPv4 or IPv6, as `host`
    resolves). The kernel spreads new connections evenly over them, where workers accepting from one shared
    socket let whichever wakes first take a whole burst. The parent keeps them open, so connections queued on
    a dead worker's socket wait for its replacement instead of being reset."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    if port:  # a port another group of `SO_REUSEPORT` sockets holds would be shared silently: refuse it
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    sockets: list[socket.socket] = []
    for _ in range(count):
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind(address if not sockets else sockets[0].getsockname())  # port 0: the first one's
        except OSError:
            sock.close()
            for bound in sockets:
                bound.close()
            raise
        sock.listen(2048)
        sockets.append(sock)
    return sockets


class _Worker:
    def __init__(self, index: int) -> None:
        self.index = index
        self.process: asyncio.subprocess.Process | None = None
        self.started_at = 0.0
        self.quick_exits = 0
        self.restarts = 0


class Supervisor:
    """The parent of `count` serving workers: starts the shared engine and the workers, restarts a worker that
    dies, and on SIGTERM or SIGINT stops the workers (each finishes its calls and stores its capture) and then
    the engine."""

    def __init__(self, settings: Settings, count: int) -> None:
        self.settings = settings
        self.count = count
        self._stop = asyncio.Event()

    def _worker_settings(self, port: int, engine: Engine | None) -> Settings:
        """The parent's settings with the port it bound and, when it started the engine, that engine's URLs."""
        update: dict[str, Any] = {"port": port}
        if engine is not None:
            from gateway.app import engine_urls

            update["vllm_url"] = ",".join(engine_urls(engine))
        return self.settings.model_copy(update=update)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._stop.set)
        listeners = listening_sockets(self.settings.host, self.settings.port, self.count)
        port = int(listeners[0].getsockname()[1])
        peer_dir = Path(tempfile.mkdtemp(prefix="kaizen-workers-"))  # private (0700) and short: socket paths
        engine = None
        try:
            engine = await self._start_engine()
            if self._stop.is_set():
                return 0  # stopped while the engine was starting
            settings = self._worker_settings(port, engine)
            workers = [_Worker(index) for index in range(self.count)]
            for worker in workers:
                await self._spawn(worker, settings, listeners[worker.index], peer_dir)
            log.info(
                "serving on http://%s:%d/v1 with %d workers (engine: %s)",
                self.settings.host,
                port,
                self.count,
                self.settings.engine,
            )
            return await self._supervise(workers, settings, listeners, peer_dir)
        finally:
            if engine is not None:
                await engine.close()
            for listener in listeners:
                listener.close()
            shutil.rmtree(peer_dir, ignore_errors=True)

    async def _start_engine(self) -> Engine | None:
        """The vLLM server(s) the workers share, when Kaizen starts them (none otherwise: an upstream or attached
        servers are reached by each worker itself). A stop while it starts cancels the start."""
        if self.settings.engine != "vllm" or self.settings.vllm_urls:
            return None
        from gateway.app import build_vllm_engine

        engine = build_vllm_engine(self.settings, adopt_adapters=True)
        starting = asyncio.create_task(engine.start(), name="engine-start")
        stopping = asyncio.create_task(self._stop.wait())
        await asyncio.wait([starting, stopping], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not starting.done():
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            return None
        starting.result()  # raises what stopped the engine from starting
        return engine

    async def _spawn(
        self, worker: _Worker, settings: Settings, listener: socket.socket, peer_dir: Path
    ) -> None:
        config = WorkerConfig(
            index=worker.index,
            count=self.count,
            listen_fd=listener.fileno(),
            peer_dir=str(peer_dir),
            settings=msgspec.json.decode(settings.model_dump_json()),
        )
        # A SIGKILLed parent cannot stop its workers itself: Linux sends them SIGTERM.
        process = await asyncio.create_subprocess_exec(
            *dying_with_parent([sys.executable, "-m", "gateway.workers"]),
            stdin=asyncio.subprocess.PIPE,
            pass_fds=(listener.fileno(),),
            env=own_modules_environment(),
        )
        assert process.stdin is not None
        process.stdin.write(msgspec.json.encode(config) + b"\n")
        await process.stdin.drain()
        process.stdin.close()
        worker.process = process
        worker.started_at = time.monotonic()

    async def _supervise(
        self, workers: list[_Worker], settings: Settings, listeners: list[socket.socket], peer_dir: Path
    ) -> int:
        status = 0
        try:
            while not self._stop.is_set():
                exits = {asyncio.create_task(w.process.wait()): w for w in workers if w.process is not None}
                stopping = asyncio.create_task(self._stop.wait())
                done, pending = await asyncio.wait([*exits, stopping], return_when=asyncio.FIRST_COMPLETED)
                for task in pending:
                    task.cancel()
                for task in done:
                    worker = exits.get(task)
                    if worker is None or self._stop.is_set():
                        continue
                    listener = listeners[worker.index]
                    if not await self._restart(worker, task.result(), settings, listener, peer_dir):
                        status = 1
                        self._stop.set()
        finally:
            await self._stop_workers(workers)
        return status

    async def _restart(
        self, worker: _Worker, code: int, settings: Settings, listener: socket.socket, peer_dir: Path
    ) -> bool:
        """Start a worker again after it exited; False when it keeps failing to start."""
        quick = time.monotonic() - worker.started_at < QUICK_EXIT_S
        worker.quick_exits = worker.quick_exits + 1 if quick else 0
        if worker.quick_exits >= MAX_QUICK_EXITS:
            log.error(
                "worker %d exited with %s %d times in a row right after starting; stopping the gateway",
                worker.index,
                code,
                worker.quick_exits,
            )
            return False
        delay = min(2.0**worker.quick_exits - 1, 30.0)
        worker.restarts += 1
        log.error(
            "worker %d exited with %s; starting it again%s (restart #%d)",
            worker.index,
            code,
            f" in {delay:.0f} s" if delay else "",
            worker.restarts,
        )
        if delay:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), delay)
            if self._stop.is_set():
                return True
        await self._spawn(worker, settings, listener, peer_dir)
        return True

    async def _stop_workers(self, workers: list[_Worker]) -> None:
        running = [w.process for w in workers if w.process is not None and w.process.returncode is None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        if not running:
            return
        log.info("stopping %d workers", len(running))
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in running)), STOP_TIMEOUT_S)
        except TimeoutError:
            for process in running:
                if process.returncode is None:
                    log.error("worker pid %d did not stop in %.0f s; killing it", process.pid, STOP_TIMEOUT_S)
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
            await asyncio.gather(*(p.wait() for p in running))


def serve_workers(settings: Settings, count: int) -> int:
    """`kaizen serve` with `count` > 1 workers (migrations are applied already); its exit status."""
    import uvloop

    return uvloop.run(Supervisor(settings, count).run())


def run_worker(config: WorkerConfig) -> None:
    """One serving worker: an ordinary gateway attached to the shared engine, accepting from the parent's port."""
    import uvicorn

    from gateway.app import build_services, create_app
    from gateway.commands.options import configure_logging
    from gateway.http_protocol import http_protocol
    from gateway.peers import WorkerPeers

    settings = Settings.model_validate(config.settings)
    if config.index:
        settings = settings.model_copy(update={"scheduler": False})  # worker 0 runs the schedules
    # A worker does not see the others' calls, so none unloads an idle adapter of the shared engine.
    settings = settings.model_copy(update={"adapter_idle_unload_s": math.inf})
    configure_logging(settings.log_level)
    peers = WorkerPeers(config.index, peer_sockets(Path(config.peer_dir), config.count), os.getppid())
    app = create_app(build_services(settings, workers=peers))
    listener = socket.socket(fileno=config.listen_fd)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            loop="uvloop",
            http=http_protocol(settings),
            log_level=settings.log_level,
            access_log=False,
            timeout_graceful_shutdown=30,
        )
    )
    server.run(sockets=[listener])


def main() -> None:
    run_worker(msgspec.json.decode(sys.stdin.buffer.readline(), type=WorkerConfig))


if __name__ == "__main__":
    main()
