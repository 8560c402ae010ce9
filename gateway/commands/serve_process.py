"""`kaizen serve` as a child process: what `kaizen demo`, benchmarks and tests start when they need a gateway
exactly as a user runs it (its own interpreter, settings from the environment, a log file)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from trainer.control.child_processes import dying_with_parent

logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class GatewayProcess:
    """`kaizen serve` in a child process: vLLM, SQLite under `data_dir`, a free loopback port and fresh keys.

    `extra_env` adds or overrides settings; `env` can still be changed before `start`. Its log goes to a file.
    It stops when the process that started it dies; `start` it from the thread that lives as long as it should.
    """

    def __init__(
        self, data_dir: Path, base_model_path: str, log_path: Path, extra_env: dict[str, str] | None = None
    ) -> None:
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.api_key, self.admin_key = secrets.token_hex(16), secrets.token_hex(16)
        self.env = {
            **os.environ,
            "KAIZEN_DATA_DIR": str(data_dir),
            "KAIZEN_DATABASE_URL": f"sqlite:///{data_dir / 'kaizen.db'}",
            "KAIZEN_HOST": "127.0.0.1",
            "KAIZEN_PORT": str(port),
            "KAIZEN_ENGINE": "vllm",
            "KAIZEN_BASE_MODEL": base_model_path,
            "KAIZEN_API_KEYS": self.api_key,
            "KAIZEN_ADMIN_KEY": self.admin_key,
            "KAIZEN_POLICY_REFRESH_S": "1",
            **(extra_env or {}),
        }
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = self.log_path.open("ab")
        # SIGTERM, a graceful stop, should the caller be SIGKILLed: no gateway left holding its port and engine.
        self.process = subprocess.Popen(
            dying_with_parent([sys.executable, "-m", "gateway", "serve"]),
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()

    async def wait_ready(self, timeout_s: float = 900) -> None:
        started = time.monotonic()
        next_note = started + 10
        async with httpx.AsyncClient(timeout=5) as client:
            while True:
                assert self.process is not None
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"the gateway exited with {self.process.returncode}; see {self.log_path}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{self.url}/readyz")).status_code == 200:
                        return
                now = time.monotonic()
                if now - started > timeout_s:
                    raise RuntimeError(
                        f"the gateway was not ready after {timeout_s:.0f} s; see {self.log_path}"
                    )
                if now >= next_note:
                    logger.info("waiting for the gateway and vLLM to start... %.0f s", now - started)
                    next_note = now + 10
                await asyncio.sleep(0.5)

    async def create_policy(self, name: str, config: dict[str, Any] | None = None) -> None:
        """Create a policy through the admin API (version 0 is the base model; building it takes a minute on a
        busy machine)."""
        body: dict[str, Any] = {"name": name} if config is None else {"name": name, "config": config}
        async with httpx.AsyncClient(
            timeout=300, headers={"Authorization": f"Bearer {self.admin_key}"}
        ) as admin:
            created = await admin.post(f"{self.url}/admin/policies", json=body)
        if created.status_code != 201:
            raise RuntimeError(f"creating policy {name!r} failed: {created.status_code} {created.text}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            logger.warning("the gateway did not stop in 90 s; killing it")
            self.process.kill()
            self.process.wait()
