"""Several vLLM replicas behind one gateway: each call goes to the least-loaded replica that serves its model.

The replicas are supervised vLLM processes (one per GPU, `KAIZEN_VLLM_REPLICAS`) or servers attached by URL
(`KAIZEN_VLLM_URL` with several URLs). Adapters are loaded on every replica: `load_adapter` returns once each
routable replica has the version, so the router switches a policy to a new version only when all of them serve it,
and a replica that was out (dead, restarting, unreachable) is given every adapter it lacks before it takes calls
again. A call whose replica fails before any of its reply reached the client (connection refused or broken, the
replica restarting) is retried on another replica and the failed one is taken out until it answers its health
check again; a stream that fails after its first chunk was relayed cannot be retried and ends with an error
event, recorded as such. The client sees one answer per call either way, and capture records exactly that one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from gateway.engines.base import Engine, EngineStream
from gateway.engines.vllm import VLLMEngine
from gateway.errors import EngineDisconnected, EngineUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Failures that mean "this replica did not answer at all": safe to send the call to another one.
_RETRYABLE = (EngineUnavailable, EngineDisconnected)


@dataclass
class ReplicaState:
    """What the pool knows about one replica."""

    engine: VLLMEngine
    routable: bool = True
    in_flight: int = 0
    served: int = 0
    failures: int = 0
    taken_out_at: float | None = None

    def snapshot(self) -> dict[str, Any]:
        return {
            "url": self.engine.base_url,
            "routable": self.routable,
            "in_flight": self.in_flight,
            "served": self.served,
            "failures": self.failures,
            "restarts": self.engine.restarts,
            "adapters": sorted(self.engine.adapters),
        }


class EnginePool(Engine):
    name = "vllm"

    def __init__(self, replicas: list[VLLMEngine], *, check_s: float = 1.0) -> None:
        if not replicas:
            raise ValueError("an engine pool needs at least one replica")
        self.capabilities = replicas[0].capabilities
        self.replicas = [ReplicaState(engine) for engine in replicas]
        self.check_s = check_s
        self.adapters: dict[str, str] = {}  # every replica should have these (name -> path)
        self.retried = 0  # calls sent again to another replica after theirs failed before answering
        self.failed_mid_stream = 0  # streams whose replica failed after their first chunk (not retryable)
        self._turn = 0
        self._adapter_lock = asyncio.Lock()
        self._monitor: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        results = await asyncio.gather(*(r.engine.start() for r in self.replicas), return_exceptions=True)
        failed = [result for result in results if isinstance(result, BaseException)]
        if failed:
            await self.close()
            raise failed[0]
        log.info("engine pool of %d replicas: %s", len(self.replicas), ", ".join(self.urls()))
        self._monitor = asyncio.create_task(self._watch(), name="engine-pool-monitor")

    async def close(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
            self._monitor = None
        await asyncio.gather(*(r.engine.close() for r in self.replicas), return_exceptions=True)

    def urls(self) -> list[str]:
        """The replicas' /v1 URLs."""
        return [r.engine.base_url for r in self.replicas]

    async def _watch(self) -> None:
        """Bring replicas that were taken out back once they answer and have every adapter; take out those that
        stopped answering (a supervised one is restarted by its own watchdog meanwhile)."""
        while True:
            await asyncio.sleep(self.check_s)
            for replica in self.replicas:
                try:
                    healthy = await replica.engine.health()
                    if healthy and not replica.routable:
                        await self._catch_up(replica)
                        replica.routable, replica.taken_out_at = True, None
                        log.info("engine replica %s is back", replica.engine.base_url)
                    elif not healthy and replica.routable:
                        self._take_out(replica, "it failed its health check")
                except Exception as exc:
                    log.warning("engine replica %s is not back yet: %s", replica.engine.base_url, exc)

    async def _catch_up(self, replica: ReplicaState) -> None:
        """Load onto a returning replica every adapter the pool serves (a restarted vLLM has none; one attached
        by URL may have restarted without us)."""
        async with self._adapter_lock:
            if (
                replica.engine.launch is None
            ):  # attached: it may have restarted unseen ("already loaded" is fine)
                replica.engine.adapters.clear()
            for name, path in self.adapters.items():
                await replica.engine.load_adapter(name, path)

    def _take_out(self, replica: ReplicaState, why: str) -> None:
        if replica.routable:
            log.warning("engine replica %s taken out of rotation: %s", replica.engine.base_url, why)
        replica.routable = False
        replica.taken_out_at = time.monotonic()

    # ------------------------------------------------------------------ routing
    def _pick(self, model: str, tried: set[int]) -> ReplicaState:
        """The routable replica with the fewest calls in flight that serves `model` (ties taken in turn)."""
        adapter = model in self.adapters
        candidates = [
            (index, replica)
            for index, replica in enumerate(self.replicas)
            if replica.routable and index not in tried and (not adapter or model in replica.engine.adapters)
        ]
        if not candidates:
            raise EngineUnavailable("no engine replica can take the call now", retry_after=2.0)
        self._turn += 1
        count = len(self.replicas)
        index, replica = min(candidates, key=lambda c: (c[1].in_flight, (c[0] - self._turn) % count))
        tried.add(index)
        return replica

    async def _call(self, model: str, attempt: Callable[[ReplicaState], Awaitable[T]]) -> T:
        """Run `attempt` on the best replica; on a failure before it answered, take the replica out and try
        the next one, until every replica was tried."""
        tried: set[int] = set()
        while True:
            replica = self._pick(model, tried)
            try:
                return await attempt(replica)
            except _RETRYABLE as exc:
                replica.failures += 1
                self._take_out(replica, exc.message)
                if len(tried) == len(self.replicas):
                    raise
                self.retried += 1

    # ------------------------------------------------------------------ calls
    async def chat(self, body: dict[str, Any]) -> Any:
        return await self._answer(body, None)

    async def relay(self, path: str, body: dict[str, Any]) -> Any:
        return await self._answer(body, path)

    async def open_stream(self, body: dict[str, Any]) -> EngineStream:
        return _PooledStream(self, body, None, await self._open(body, set(), None))

    async def open_relay_stream(self, path: str, body: dict[str, Any]) -> EngineStream:
        return _PooledStream(self, body, path, await self._open(body, set(), path))

    async def _answer(self, body: dict[str, Any], path: str | None) -> Any:
        """A non-streamed call: chat completions, or another route the engines serve (`path`)."""

        async def attempt(replica: ReplicaState) -> Any:
            replica.in_flight += 1
            try:
                if path is None:
                    answer = await replica.engine.chat(body)
                else:
                    answer = await replica.engine.relay(path, body)
            finally:
                replica.in_flight -= 1
            replica.served += 1
            return answer

        return await self._call(str(body.get("model")), attempt)

    async def _open(
        self, body: dict[str, Any], tried: set[int], path: str | None
    ) -> tuple[ReplicaState, EngineStream]:
        async def attempt(replica: ReplicaState) -> tuple[ReplicaState, EngineStream]:
            replica.in_flight += 1
            try:
                if path is None:
                    return replica, await replica.engine.open_stream(body)
                return replica, await replica.engine.open_relay_stream(path, body)
            except BaseException:
                replica.in_flight -= 1
                raise

        return await self._call(str(body.get("model")), attempt)

    async def list_models(self) -> list[str]:
        names: set[str] = set()
        for replica in self.replicas:
            if replica.routable:
                with contextlib.suppress(Exception):
                    names.update(await replica.engine.list_models())
        return sorted(names)

    async def health(self) -> bool:
        """Ready while any replica serves."""
        for replica in self.replicas:
            if replica.routable and await replica.engine.health():
                return True
        return False

    # ------------------------------------------------------------------ adapters
    def loaded_adapters(self) -> list[str]:
        return list(self.adapters)

    async def load_adapter(self, name: str, path: str) -> None:
        """Load on every routable replica; returns once all have it (raises if one refuses)."""
        if name in self.adapters and all(name in r.engine.adapters for r in self.replicas if r.routable):
            return
        async with self._adapter_lock:
            routable = [r for r in self.replicas if r.routable]
            results = await asyncio.gather(
                *(r.engine.load_adapter(name, path) for r in routable), return_exceptions=True
            )
            for replica, result in zip(routable, results, strict=True):
                if isinstance(result, _RETRYABLE):
                    self._take_out(replica, result.message)  # it gets the adapter when it is back
                elif isinstance(result, BaseException):
                    raise result
            self.adapters[name] = path

    async def unload_adapter(self, name: str) -> None:
        async with self._adapter_lock:
            self.adapters.pop(name, None)
            for replica in self.replicas:
                try:
                    await replica.engine.unload_adapter(name)
                except Exception as exc:  # a replica that is out has lost it anyway
                    log.warning("could not unload %s from %s: %s", name, replica.engine.base_url, exc)

    def snapshot(self) -> dict[str, Any]:
        return {
            "engine": self.name,
            "replicas": [r.snapshot() for r in self.replicas],
            "retried": self.retried,
            "failed_mid_stream": self.failed_mid_stream,
        }


class _PooledStream(EngineStream):
    """A stream on one replica that moves to another if its replica fails before the first chunk."""

    def __init__(
        self,
        pool: EnginePool,
        body: dict[str, Any],
        path: str | None,
        opened: tuple[ReplicaState, EngineStream],
    ) -> None:
        self._pool = pool
        self._body = body
        self._path = path
        self._replica, self._stream = opened
        self._tried = {pool.replicas.index(self._replica)}
        self._closed = False

    def ready(self) -> bool:
        return self._stream.ready()

    async def __aiter__(self) -> AsyncIterator[Any]:
        relayed = False
        while True:
            try:
                async for chunk in self._stream:
                    relayed = True
                    yield chunk
                self._replica.served += 1
                return
            except _RETRYABLE as exc:
                self._replica.failures += 1
                self._pool._take_out(self._replica, exc.message)
                if relayed:
                    self._pool.failed_mid_stream += 1
                    raise
                await self._release()
                self._pool.retried += 1
                self._replica, self._stream = await self._pool._open(self._body, self._tried, self._path)

    async def _release(self) -> None:
        with contextlib.suppress(Exception):
            await self._stream.close()
        self._replica.in_flight -= 1

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self._release()
