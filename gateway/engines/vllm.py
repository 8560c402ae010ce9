"""The `vllm` engine: vLLM's OpenAI server as a supervised subprocess (or attached by URL), with runtime LoRA.

The gateway owns the process: it starts it with LoRA and tool calling enabled, waits for health with a visible
progress message, restarts it when it dies (calls meanwhile get 503 + Retry-After, which the OpenAI SDKs
retry), re-loads the adapters that were loaded, and stops it on shutdown. Every call asks for sampled token
ids and *processed* logprobs (after temperature/top-p: the behaviour policy's probabilities).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.engines.base import Engine, EngineCapabilities, EngineStream
from gateway.engines.http import OpenAIHTTPClient
from gateway.errors import EngineUnavailable, InvalidRequest
from trainer.control.child_processes import dying_with_parent, signal_group

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
#: Seconds between two reads of the adapters a shared server holds (`adopt_adapters`).
ADOPT_INTERVAL_S = 5.0


def find_vllm_python(configured: str) -> str:
    """The interpreter of the environment vLLM is installed in: configured, the install's `.venv-vllm`, or ours."""
    if configured:
        return configured
    bundled = REPO_ROOT / ".venv-vllm" / "bin" / "python"
    if bundled.exists():
        return str(bundled)
    return sys.executable


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel's choice), for a server we start."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def require_free_port(port: int) -> None:
    """Raise when another process holds `port` on 127.0.0.1: a server answering there is not ours, and
    supervising it would restart and reload adapters in a loop."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            raise RuntimeError(
                f"cannot start vLLM on port {port}: another process is using it ({exc.strerror}). "
                "Set KAIZEN_VLLM_PORT to a free port, or to 0 to let Kaizen pick one, or set KAIZEN_VLLM_URL "
                "to attach to a vLLM server that is already running."
            ) from exc


@dataclass
class VLLMLaunch:
    """How to start the server: everything the command line and environment need."""

    python: str
    model: str
    served_name: str
    port: int
    max_model_len: int = 2048
    max_loras: int = 4
    max_lora_rank: int = 16
    kv_cache_gib: int = 2
    dtype: str = "bfloat16"
    tool_call_parser: str | None = None
    tool_strict_level: str = "parameter"
    chat_template: str | None = None
    extra_args: list[str] = field(default_factory=list)
    #: Variables of this server alone, over the gateway's own (a replica's GPUs or CPU cores).
    env: dict[str, str] = field(default_factory=dict)

    def command(self) -> list[str]:
        cmd = [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model,
            "--served-model-name", self.served_name,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len),
            "--enable-lora",
            "--max-loras", str(self.max_loras),
            "--max-lora-rank", str(self.max_lora_rank),
            "--logprobs-mode", "processed_logprobs",
            "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if self.tool_call_parser:
            cmd += ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_call_parser]
        if self.tool_call_parser and self.tool_strict_level:
            # `parameter`: every tool call is held to its tool's JSON schema by structured decoding, the forced
            # ones (`required`, a named function) from the first token and, under `auto`, one the model starts
            # on its own. Without it only the call's envelope is, and a small model's forced call is often
            # free-form text no parser recovers.
            cmd += ["--tool-strict-level", self.tool_strict_level]
        if self.chat_template:
            cmd += ["--chat-template", self.chat_template]
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_cache_gib))
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        return env | self.env


class VLLMEngine(Engine):
    name = "vllm"
    capabilities = EngineCapabilities(
        logprobs=True, token_ids=True, adapters=True, allowed_tools=False, prompt_logprobs=False
    )

    def __init__(
        self,
        *,
        base_url: str,
        served_name: str,
        launch: VLLMLaunch | None,
        log_path: Path | None = None,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        max_connections: int = 1024,
        startup_timeout_s: float = 900.0,
        adopt_adapters: bool = False,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        #: Other gateways (serving workers) load adapters into this server: learn them from it, so that a restart
        #: re-loads theirs too.
        self.adopt_adapters = adopt_adapters
        self.served_name = served_name
        self.launch = launch
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.client = OpenAIHTTPClient(
            base_url,
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            max_connections=max_connections,
        )
        self.adapters: dict[str, str] = {}  # loaded adapter name -> path, re-loaded after a restart
        self.restarts = 0
        self._process: asyncio.subprocess.Process | None = None
        self._rpc_dir: Path | None = None  # the running server's private directory for its ZeroMQ sockets
        self._ready = asyncio.Event()
        self._watchdog: asyncio.Task[None] | None = None
        self._stopping = False
        self._adapter_lock = asyncio.Lock()

    @property
    def health_url(self) -> str:
        return self.base_url.removesuffix("/v1") + "/health"

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self.launch is not None:
            require_free_port(self.launch.port)
            await self._spawn()
        try:
            await self._wait_healthy()
        except BaseException:
            # A server that never became healthy (or whose start-up was cancelled) is stopped here: the
            # gateway's shutdown only runs after a successful start, and the server's own session outlives us.
            await self._terminate()
            raise
        self._ready.set()
        if self.launch is not None:
            self._watchdog = asyncio.create_task(self._watch(), name="vllm-watchdog")

    async def close(self) -> None:
        self._stopping = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
        await self._terminate()
        await self.client.close()

    async def _spawn(self) -> None:
        assert self.launch is not None
        output: Any = asyncio.subprocess.DEVNULL
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            output = self.log_path.open("ab")
        command = self.launch.command()
        env = self.launch.environment()
        if "VLLM_RPC_BASE_PATH" not in env:
            # vLLM's processes talk over ZeroMQ sockets that it names in this directory (the system's temporary
            # one by default) and leaves there, even after a clean stop: a private one goes with the server.
            self._rpc_dir = Path(tempfile.mkdtemp(prefix="kaizen-vllm-"))
            env["VLLM_RPC_BASE_PATH"] = str(self._rpc_dir)
        log.info("starting vLLM: %s", " ".join(command))
        # Its own session (stopped as a group), yet SIGTERMed when the gateway dies, even by SIGKILL.
        self._process = await asyncio.create_subprocess_exec(
            *dying_with_parent(command),
            env=env,
            stdout=output,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )

    async def _wait_healthy(self) -> None:
        started = time.monotonic()
        next_note = started + 10
        while True:
            if await self.client.ping(self.health_url):
                log.info("vLLM is ready after %.1f s (%s)", time.monotonic() - started, self.base_url)
                return
            if self._process is not None and self._process.returncode is not None:
                raise RuntimeError(
                    f"vLLM exited with code {self._process.returncode} while starting; see {self.log_path}"
                )
            now = time.monotonic()
            if now - started > self.startup_timeout_s:
                raise TimeoutError(f"vLLM did not become healthy within {self.startup_timeout_s:.0f} s")
            if now >= next_note:
                log.info("waiting for vLLM to load the model... %.0f s", now - started)
                next_note = now + 10
            await asyncio.sleep(0.5)

    async def _terminate(self) -> None:
        """Stop the server and every process it spawned (engine core, workers): they share its process group,
        and survive the API process if it is killed alone."""
        process = self._process
        if process is None:
            self._remove_rpc_dir()  # a start that failed before the server ran
            return
        try:
            signal_group(process.pid, signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.wait(), timeout=20)
            await asyncio.sleep(0.5)
        finally:
            # Also when cancelled (a shutdown while the watchdog replaces a dead server): the group's survivors
            # (an engine core ignoring SIGTERM) would otherwise outlive us, and nothing else knows their pids.
            signal_group(process.pid, signal.SIGKILL)
            self._process = None
            self._remove_rpc_dir()
        await process.wait()

    def _remove_rpc_dir(self) -> None:
        if self._rpc_dir is not None:
            shutil.rmtree(self._rpc_dir, ignore_errors=True)
            self._rpc_dir = None

    async def _watch(self) -> None:
        """Restart the server when it dies (or stops answering), then re-load the adapters it had."""
        failures = 0
        adopted_at = -float("inf")
        while not self._stopping:
            await asyncio.sleep(1.0)
            dead = self._process is None or self._process.returncode is not None
            if not dead:
                failures = 0 if await self.client.ping(self.health_url, timeout_s=5) else failures + 1
                dead = failures >= 5
            if not dead:
                if (
                    self.adopt_adapters
                    and failures == 0
                    and time.monotonic() - adopted_at >= ADOPT_INTERVAL_S
                ):
                    await self._adopt()
                    adopted_at = time.monotonic()
                continue
            self._ready.clear()
            self.restarts += 1
            log.error("vLLM is down; restarting it (restart #%d)", self.restarts)
            await self._terminate()
            try:
                await self._spawn()
                await self._wait_healthy()
                async with self._adapter_lock:
                    for name, path in self.adapters.items():
                        await self._load(name, path)
            except Exception:
                log.exception("restarting vLLM failed; trying again")
                continue
            failures = 0
            self._ready.set()

    async def _adopt(self) -> None:
        try:
            loaded = await self.client.lora_adapters()
        except Exception as exc:  # a busy or restarting server: the last list stays
            log.debug("could not list the adapters of %s: %s", self.base_url, exc)
            return
        async with self._adapter_lock:
            if loaded != self.adapters:
                log.info("the engine holds adapters %s", ", ".join(sorted(loaded)) or "(none)")
            self.adapters = loaded

    def _require_ready(self) -> None:
        if not self._ready.is_set():
            raise EngineUnavailable("the engine is restarting", retry_after=5.0)

    # ------------------------------------------------------------------ calls
    async def chat(self, body: dict[str, Any]) -> Any:
        self._require_ready()
        try:
            return await self.client.chat(body)
        except InvalidRequest as exc:
            await self._reload_lost_adapter(body, exc)
            return await self.client.chat(body)

    async def open_stream(self, body: dict[str, Any]) -> EngineStream:
        self._require_ready()
        try:
            return await self.client.open_stream(body)
        except InvalidRequest as exc:
            await self._reload_lost_adapter(body, exc)
            return await self.client.open_stream(body)

    async def relay(self, path: str, body: dict[str, Any]) -> Any:
        self._require_ready()
        try:
            return await self.client.request(path, body)
        except InvalidRequest as exc:
            await self._reload_lost_adapter(body, exc)
            return await self.client.request(path, body)

    async def open_relay_stream(self, path: str, body: dict[str, Any]) -> EngineStream:
        self._require_ready()
        try:
            return await self.client.open_stream(body, path)
        except InvalidRequest as exc:
            await self._reload_lost_adapter(body, exc)
            return await self.client.open_stream(body, path)

    async def _reload_lost_adapter(self, body: dict[str, Any], error: InvalidRequest) -> None:
        """The server answered 404 for an adapter this gateway loaded: it was restarted by someone else (the
        gateway that supervises a shared server, or an operator), which forgets runtime adapters. Load it again
        so the caller can retry once; any other error is the caller's."""
        name = body.get("model")
        path = self.adapters.get(name) if isinstance(name, str) else None
        if error.status_code != 404 or path is None:
            raise error
        log.warning("the engine no longer holds adapter %s (restarted elsewhere?); loading it again", name)
        async with self._adapter_lock:
            await self._load(str(name), path)

    async def list_models(self) -> list[str]:
        return await self.client.list_models()

    async def health(self) -> bool:
        return self._ready.is_set() and await self.client.ping(self.health_url)

    def snapshot(self) -> dict[str, Any]:
        return {
            "engine": self.name,
            "replicas": [
                {
                    "url": self.base_url,
                    "routable": self._ready.is_set(),
                    "restarts": self.restarts,
                    "adapters": sorted(self.adapters),
                }
            ],
        }

    # ------------------------------------------------------------------ adapters
    async def _load(self, name: str, path: str) -> None:
        try:
            await self.client.post_json("/load_lora_adapter", {"lora_name": name, "lora_path": path})
        except InvalidRequest as exc:
            # Another gateway attached to this server loaded it (or this one, before it restarted): a version
            # name is never reused for other weights, so what is loaded is what was asked for.
            if "already been loaded" not in exc.message:
                raise

    def loaded_adapters(self) -> list[str]:
        return list(self.adapters)

    async def load_adapter(self, name: str, path: str) -> None:
        async with self._adapter_lock:
            if name in self.adapters:
                return
            self._require_ready()
            started = time.perf_counter()
            await self._load(name, path)
            self.adapters[name] = path
            log.info("loaded adapter %s in %.2f s", name, time.perf_counter() - started)

    async def unload_adapter(self, name: str) -> None:
        async with self._adapter_lock:
            if self.adapters.pop(name, None) is None:
                return
            await self.client.post_json("/unload_lora_adapter", {"lora_name": name})
            log.info("unloaded adapter %s", name)
