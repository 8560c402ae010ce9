"""A real `kaizen serve` child process in front of the scripted upstream, for fault tests and benchmarks that
must kill, stop and restart the gateway as an operating system process (SIGKILL, SIGTERM)."""

from __future__ import annotations

import asyncio
import secrets
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletion

from gateway.commands.serve_process import GatewayProcess
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


def sdk(gateway: GatewayProcess) -> AsyncOpenAI:
    """The OpenAI SDK's async client on the gateway, no retries. Close it (`async with`, `close()`) in the loop
    that used it: one left to the garbage collector has its close scheduled on the loop of whichever thread runs
    the collection, such as a scripted upstream's, and that close of this loop's sockets from another thread
    can leave a later call unanswered until its timeout."""
    return AsyncOpenAI(base_url=gateway.url + "/v1", api_key=gateway.api_key, max_retries=0, timeout=60)


@dataclass(frozen=True)
class SdkChat:
    """A chat call's answer as the SDK parsed it, with the HTTP headers it came with (ids, the served version)."""

    headers: httpx.Headers
    completion: ChatCompletion


async def sdk_chat(gateway: GatewayProcess, **request: Any) -> SdkChat:
    """One non-streamed chat call through the SDK on a client of its own, closed before returning."""
    async with sdk(gateway) as client:
        raw = await client.chat.completions.with_raw_response.create(**request)
        return SdkChat(raw.headers, raw.parse())


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


def replica_set(
    count: int, data_dir: Path, database_url: str, engine_url: str, extra_env: dict[str, str] | None = None
) -> list[GatewayProcess]:
    """`count` gateways as a load balancer would front them: one database, one data directory (the adapter
    store), the same keys; each with its own port and log. The engine is attached by URL as vLLM
    (`KAIZEN_VLLM_URL`), so policies and their adapter versions are served through it."""
    data_dir.mkdir(parents=True, exist_ok=True)
    api_key, admin_key = secrets.token_hex(16), secrets.token_hex(16)
    env = {
        "KAIZEN_ENGINE": "vllm",
        "KAIZEN_VLLM_URL": engine_url,
        "KAIZEN_DATABASE_URL": database_url,
        "KAIZEN_API_KEYS": api_key,
        "KAIZEN_ADMIN_KEY": admin_key,
        "KAIZEN_LOG_LEVEL": "info",
        **(extra_env or {}),
    }
    replicas = []
    for index in range(count):
        replica = GatewayProcess(data_dir, "scripted-1", data_dir / f"gateway-{index}.log", env)
        replica.api_key, replica.admin_key = api_key, admin_key
        replicas.append(replica)
    return replicas
