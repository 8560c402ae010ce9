"""The vLLM port: a free one by default, and a port another process holds refused at start-up (no vLLM run)."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

from gateway.app import build_vllm_engine, engine_url
from gateway.engines.vllm import VLLMEngine, VLLMLaunch, free_loopback_port, require_free_port
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


def test_a_server_that_never_becomes_healthy_is_stopped(tmp_path: Path) -> None:
    """Start-up that times out must not leave the server running: it sits in its own session, so nothing
    else would ever stop it."""
    pid_file = tmp_path / "pid"
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 600\n")
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
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
