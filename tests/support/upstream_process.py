"""The scripted upstream in its own process, so a test can SIGKILL it like a crashed engine and start it again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from tests.support.ports import free_port


class UpstreamProcess:
    """`python -m tests.support.scripted_upstream` on a fixed loopback port that survives restarts."""

    def __init__(self) -> None:
        self.port = free_port()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout_s: float = 30.0) -> UpstreamProcess:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tests.support.scripted_upstream", "--port", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError("the scripted upstream exited during start-up")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError("the scripted upstream did not start")

    def kill(self) -> None:
        """SIGKILL: no graceful close of open streams, as when an engine crashes or is OOM-killed."""
        if self._process is not None and self._process.poll() is None:
            os.kill(self._process.pid, signal.SIGKILL)
            self._process.wait(timeout=10)
        self._process = None
