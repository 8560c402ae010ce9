"""Shadow evaluation on the gateway: a shadow rollout's candidate answers copies of calls nobody sees.

When a policy runs a rollout in `shadow` mode, a successful chat call to it by its bare name, answered by the
active version, whose sticky key (`user`, else the episode; the key `ModelRouter.assign` splits on) falls in the
rollout's share is copied here after it was answered. `offer` only puts the copy in a bounded queue: a full
queue drops it (counted), the call never waits. Background tasks send each copy straight to the engine as one
non-streamed answer (`n` = 1, the client's sampling parameters) from the candidate's adapter, and store the
context and both replies, redacted as the policy's calls are, as a `shadow_pairs` row, in batches.

A copy never goes through capture: no call, no episode and no stitch key is written for it, so it never trains
a version and never joins a conversation. The canary monitor scores the pairs and decides on them
(`trainer.control.shadow_scoring`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from gateway.chat import CallContext, narrowed_tools
from gateway.engines.base import Engine
from gateway.normalize import Captured, normalize_completion
from gateway.protocol import AllowedToolsChoice
from gateway.redaction import Redactor
from gateway.routing import ModelRouter, Route, adapter_name, trial_bucket
from storage.database import Database
from storage.models import EPISODE_SOURCE_TRAFFIC
from storage.shadows import NewPair, add_pairs

log = logging.getLogger(__name__)

# A full queue is logged on its first drop and then every this many, not once per call.
_LOG_DROPS_EVERY = 100


@dataclass(frozen=True)
class _Copy:
    """An answered call waiting for the candidate's answer."""

    rollout_id: int
    policy: str
    version: int
    call_id: str
    model: str  # the `model` the client asked for
    body: dict[str, Any]  # the request as the client sent it
    allowed_tools: AllowedToolsChoice | None
    served: dict[str, Any]  # the serving version's reply message, as the client got it
    redactor: Redactor | None  # the policy's, when the call was captured


class ShadowTap:
    """Copies calls to a shadow rollout's candidate off the request path and stores the pairs."""

    def __init__(
        self, engine: Engine, router: ModelRouter, database: Database, *, queue_size: int, concurrency: int
    ) -> None:
        if queue_size < 1:
            raise ValueError("a shadow tap needs room for one copied call at least")
        self.engine = engine
        self.router = router
        self.database = database
        self.queue_size = queue_size
        self.concurrency = concurrency
        #: copied, dropped (queue full), stale (the rollout ended first), failed (the engine did not answer),
        #: stored, lost (the database refused the batch)
        self.counts: Counter[str] = Counter()
        self._queue: asyncio.Queue[_Copy] = asyncio.Queue(queue_size)
        self._pending: list[NewPair] = []
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------ request path
    def offer(self, ctx: CallContext, captured: Captured) -> None:
        """Copy an answered call for its policy's shadow candidate when it falls in the share; never waits."""
        route = ctx.route
        if not route.by_name or route.policy is None:
            return
        state = self.router.policies.get(route.policy)
        trial = state.trial if state is not None else None
        if state is None or trial is None or trial.mode != "shadow" or trial.version not in state.versions:
            return
        if ctx.source != EPISODE_SOURCE_TRAFFIC or trial_bucket(trial.rollout_id, ctx.sticky) >= trial.share:
            return
        choices = captured.response.get("choices") or []
        if not choices or not isinstance(choices[0].get("message"), dict):
            return
        choice = ctx.request.tool_choice
        copy = _Copy(
            trial.rollout_id,
            route.policy,
            trial.version,
            ctx.call_id,
            ctx.request.model,
            ctx.body,
            choice if isinstance(choice, AllowedToolsChoice) else None,
            choices[0]["message"],
            self.router.redactor(route.policy),
        )
        try:
            self._queue.put_nowait(copy)
        except asyncio.QueueFull:
            self.counts["dropped"] += 1
            if self.counts["dropped"] % _LOG_DROPS_EVERY == 1:
                log.warning(
                    "shadow queue full (%d): %d copied calls dropped so far; raise KAIZEN_SHADOW_QUEUE or lower "
                    "the rollout's share",
                    self.queue_size,
                    self.counts["dropped"],
                )
            return
        self.counts["copied"] += 1

    # ------------------------------------------------------------------ background
    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._answer_copies(), name=f"shadow-{i}") for i in range(self.concurrency)
        ]
        self._tasks.append(asyncio.create_task(self._write_pairs(), name="shadow-writer"))

    async def stop(self) -> None:
        """Abandon the copies not answered yet and store the pairs already answered."""
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        await self._flush()

    async def _answer_copies(self) -> None:
        while True:
            copy = await self._queue.get()
            try:
                await self._answer(copy)
            except Exception as exc:  # the live call is long answered: a failed copy only costs its pair
                self.counts["failed"] += 1
                log.warning(
                    "shadow copy of call %s for %s@%d failed: %s",
                    copy.call_id,
                    copy.policy,
                    copy.version,
                    exc,
                )
            finally:
                self._wake.set()

    async def _answer(self, copy: _Copy) -> None:
        state = self.router.policies.get(copy.policy)
        trial = state.trial if state is not None else None
        if (
            state is None
            or trial is None
            or trial.rollout_id != copy.rollout_id
            or copy.version not in state.versions
        ):
            self.counts["stale"] += 1
            return
        route = Route(
            adapter_name(copy.policy, copy.version), copy.policy, copy.version, state.versions[copy.version]
        )
        body = {k: v for k, v in copy.body.items() if k not in ("stream", "stream_options")}
        body["model"], body["n"] = route.engine_model, 1
        if copy.allowed_tools is not None and not self.engine.capabilities.allowed_tools:
            body.update(narrowed_tools(body.get("tools") or [], copy.allowed_tools))
        await self.router.acquire(route)  # in flight: the adapter is not unloaded under the call
        try:
            raw = await self.engine.chat(body)
        finally:
            self.router.release(route)
        _, captured = normalize_completion(
            raw, response_id=f"shadow-{copy.call_id}", model=copy.model, keep_logprobs=False
        )
        messages: list[Any] = list(copy.body.get("messages") or [])
        served, shadow = copy.served, captured.response["choices"][0]["message"]
        # Stored as the call itself was: nothing unredacted reaches the database.
        if copy.redactor is not None:
            messages, served, shadow = (copy.redactor.value(v) for v in (messages, served, shadow))
        self._pending.append(
            NewPair(copy.rollout_id, copy.call_id, messages, served, shadow, datetime.now(UTC))
        )

    async def _write_pairs(self) -> None:
        """Store answered pairs; those answered while a batch is written go in the next one."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._flush()

    async def _flush(self) -> None:
        pairs, self._pending = self._pending, []
        if not pairs:
            return
        try:
            async with self.database.session() as session:
                await add_pairs(session, pairs)
                await session.commit()
        except Exception as exc:  # evidence, not traffic: a lost batch only means fewer pairs
            self.counts["lost"] += len(pairs)
            log.warning("could not store %d shadow pairs: %s", len(pairs), exc)
        else:
            self.counts["stored"] += len(pairs)
