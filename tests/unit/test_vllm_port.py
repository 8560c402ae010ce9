"""The vLLM port: a free one by default, and a port another process holds refused at start-up (no vLLM run)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from gateway.app import build_vllm_engine, engine_url
from gateway.engines.vllm import VLLMEngine, VLLMLaunch, free_loopback_port, require_free_port
from gateway.errors import InvalidRequest
from gateway.scheduling import runner_config
from gateway.settings import Settings
from tests.conftest import MODELS_DIR


def test_free_loopback_port_can_be_bound() -> None:
    port = free_loopback_port()
    assert 0 < port < 65536
    require_free_port(port)  # nothing holds it
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_default_vllm_port_is_picked_and_used_everywhere(tmp_path: Path) -> None:
    (tmp_path / "models").symlink_to(MODELS_DIR)
    settings = Settings.load(data_dir=tmp_path, engine="vllm", port=0)
    assert settings.vllm_port == 0
    engine = build_vllm_engine(settings)
    assert isinstance(engine, VLLMEngine) and engine.launch is not None
    port = engine.launch.port
    assert port != 0 and f"--port {port} " in " ".join(engine.launch.command()) + " "
    assert engine.base_url == f"http://127.0.0.1:{port}/v1"
    # The scheduler puts the engine it really runs to sleep, not one at a port computed from the settings.
    assert runner_config(settings, engine_url(engine)).engine_url == engine.base_url
    asyncio.run(engine.client.close())


def test_a_port_another_process_holds_stops_start_up() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        launch = VLLMLaunch(python="/nonexistent/python", model="m", served_name="m", port=port)
        engine = VLLMEngine(base_url=f"http://127.0.0.1:{port}/v1", served_name="m", launch=launch)

        async def start() -> None:
            try:
                await engine.start()
            finally:
                await engine.close()

        with pytest.raises(RuntimeError, match=f"port {port}: another process is using it"):
            asyncio.run(start())


def start_a_server_that_never_becomes_healthy(tmp_path: Path, script: str) -> None:
    """Start a stand-in for vLLM (`script`, a shell script run as its python) that never answers /health; the
    start-up times out."""
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\n{script}\nexec sleep 600\n")
    fake.chmod(0o755)
    port = free_loopback_port()
    launch = VLLMLaunch(python=str(fake), model="m", served_name="m", port=port)
    engine = VLLMEngine(
        base_url=f"http://127.0.0.1:{port}/v1", served_name="m", launch=launch, startup_timeout_s=1.0
    )

    async def start() -> None:
        try:
            await engine.start()
        finally:
            await engine.client.close()

    with pytest.raises(TimeoutError, match="did not become healthy"):
        asyncio.run(start())


def test_a_server_that_never_becomes_healthy_is_stopped(tmp_path: Path) -> None:
    """Start-up that times out must not leave the server running: it sits in its own session, so nothing
    else would ever stop it."""
    pid_file = tmp_path / "pid"
    start_a_server_that_never_becomes_healthy(tmp_path, f"echo $$ > {pid_file}")
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_the_servers_socket_directory_goes_with_it(tmp_path: Path) -> None:
    """vLLM names its ZeroMQ sockets in VLLM_RPC_BASE_PATH and leaves them there even after a clean stop (seven
    per start, in the system's temporary directory by default): each server gets a private directory, removed
    when the server is stopped."""
    seen = tmp_path / "rpc-dir"
    script = f'echo "$VLLM_RPC_BASE_PATH" > {seen}\ntouch "$VLLM_RPC_BASE_PATH/socket-left"'
    start_a_server_that_never_becomes_healthy(tmp_path, script)
    rpc_dir = Path(seen.read_text().strip())
    assert rpc_dir.name.startswith("kaizen-vllm-") and rpc_dir.parent == Path(tempfile.gettempdir())
    assert not rpc_dir.exists()


FAKE_SERVER = """#!{python}
import http.server, os, subprocess, sys
# vLLM's shape: an API server that leads its process group, and an engine core beside it (this one ignores
# SIGTERM, as a busy core can); both pids go to the list the test checks.
core = subprocess.Popen(
    [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"]
)
with open({pids!r}, "a") as pids:
    pids.write(f"{{os.getpid()}} {{core.pid}}\\n")


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


port = int(sys.argv[sys.argv.index("--port") + 1])
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_shutdown_during_a_restart_leaves_no_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway stopping while its watchdog replaces a dead server: the dead server's group (an engine core
    that ignores SIGTERM) is still SIGKILLed, and no new server is left behind, nor a socket directory."""
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    pids = tmp_path / "pids"
    fake = tmp_path / "python"
    fake.write_text(FAKE_SERVER.format(python=sys.executable, pids=str(pids)))
    fake.chmod(0o755)
    port = free_loopback_port()
    launch = VLLMLaunch(python=str(fake), model="m", served_name="m", port=port)
    engine = VLLMEngine(base_url=f"http://127.0.0.1:{port}/v1", served_name="m", launch=launch)

    async def run() -> None:
        await engine.start()
        server = int(pids.read_text().split()[0])
        os.kill(server, signal.SIGKILL)
        while engine.restarts == 0:  # noqa: ASYNC110 (the watchdog has begun replacing it; no event says so)
            await asyncio.sleep(0.01)
        await engine.close()

    asyncio.run(run())
    started = [int(pid) for pid in pids.read_text().split()]
    assert started, "the fake server never started"
    deadline = time.monotonic() + 10  # a SIGKILL is delivered, not awaited
    while (left := [pid for pid in started if _running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == [], f"still running: {left} (servers and cores: {pids.read_text()!r})"
    assert not list((tmp_path / "tmp").glob("kaizen-vllm-*"))


class ForgetfulServer:
    """A vLLM stand-in with runtime adapters that it forgets on `restart`, answering 404 (vLLM's shape) for a
    model it does not hold."""

    def __init__(self) -> None:
        self.adapters: set[str] = set()
        self.loads = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def load(self, request: web.Request) -> web.Response:
        self.adapters.add((await request.json())["lora_name"])
        self.loads += 1
        return web.Response(text="Success")

    async def chat(self, request: web.Request) -> web.Response:
        model = (await request.json())["model"]
        if model not in self.adapters:
            error = {"message": f"The model `{model}` does not exist.", "type": "NotFoundError", "code": 404}
            return web.json_response({"error": error}, status=404)
        return web.json_response({"id": "c", "object": "chat.completion", "model": model, "choices": []})


def test_an_attached_engine_loads_an_adapter_again_after_the_server_forgot_it() -> None:
    """A server restarted by another process (the gateway that supervises it, for a replica attached by URL)
    holds no runtime adapters: the next call loads the adapter again and is answered, instead of every call
    failing with 404 until this gateway restarts."""
    fake = ForgetfulServer()

    async def scenario() -> tuple[Any, Any]:
        runner = web.AppRunner(fake.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        engine = VLLMEngine(base_url=f"http://127.0.0.1:{port}/v1", served_name="m", launch=None)
        try:
            await engine.start()
            await engine.load_adapter("p@1", "/adapters/p/1")
            fake.adapters.clear()  # the server restarted
            answered = await engine.chat({"model": "p@1", "messages": []})
            with pytest.raises(InvalidRequest) as unknown:  # a model nobody loaded stays a 404
                await engine.chat({"model": "q@1", "messages": []})
            return answered, unknown.value
        finally:
            await engine.close()
            await runner.cleanup()

    answered, unknown = asyncio.run(scenario())
    assert answered["model"] == "p@1"
    assert fake.loads == 2 and fake.adapters == {"p@1"}
    assert unknown.status_code == 404
