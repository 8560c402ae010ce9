"""A real `kaizen serve` child process in front of the scripted upstream, for fault tests and benchmarks that
must kill, stop and restart the gateway as an operating system process (SIGKILL, SIGTERM)."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from gateway.serve_process import GatewayProcess
from tests.support import proc_stats


def upstream_gateway(
    data_dir: Path, database_url: str, upstream_url: str, extra_env: dict[str, str] | None = None
) -> GatewayProcess:
    """A child gateway with `KAIZEN_ENGINE=upstream`; nothing runs until `start()`. Restarting it (`start()`
    again after it exited) keeps its port, keys, data directory and database."""
    data_dir.mkdir(parents=True, exist_ok=True)
    env = {
        "KAIZEN_ENGINE": "upstream",
        "KAIZEN_UPSTREAM_URL": upstream_url,
        "KAIZEN_UPSTREAM_TOKEN_IDS": "true",
        "KAIZEN_DATABASE_URL": database_url,
        "KAIZEN_SCHEDULER": "false",
        "KAIZEN_LOG_LEVEL": "warning",
        **(extra_env or {}),
    }
    # The base model is not used by the upstream engine; the scripted upstream's model name keeps it honest.
    return GatewayProcess(data_dir, "scripted-1", data_dir / "gateway.log", env)


async def start(gateway: GatewayProcess, timeout_s: float = 60) -> None:
    gateway.start()
    await gateway.wait_ready(timeout_s=timeout_s)


async def kill(gateway: GatewayProcess) -> None:
    """SIGKILL: no shutdown code runs, as in an out-of-memory kill or a power cut of the container."""
    assert gateway.process is not None
    gateway.process.send_signal(signal.SIGKILL)
    await asyncio.to_thread(gateway.process.wait)


async def terminate(gateway: GatewayProcess, timeout_s: float = 60) -> int:
    """SIGTERM and wait for the graceful shutdown to end; returns the exit status."""
    assert gateway.process is not None
    gateway.process.send_signal(signal.SIGTERM)
    return await asyncio.to_thread(gateway.process.wait, timeout_s)


def rss_bytes(gateway: GatewayProcess) -> int:
    """Resident memory of the gateway process (its capture writer is a process of its own)."""
    assert gateway.process is not None
    return proc_stats.rss_bytes(gateway.process.pid)
