"""Which engine model serves a request's `model`: engine models as they are, policies by version.

The request path only reads in-memory state; a background task refreshes it from the engine (and, with the
vLLM engine, from the policies table), so resolving a model never waits on the network or the database.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from gateway.engines.base import Engine
from gateway.errors import NotFound

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Route:
    engine_model: str  # the name the engine knows
    policy: str | None  # the policy (or plain model) the call is stored under
    adapter_version: int | None


class ModelRouter:
    """Resolves `model` strings against what the engine serves; refreshed in the background."""

    def __init__(self, engine: Engine, refresh_s: float) -> None:
        self.engine = engine
        self.refresh_s = refresh_s
        self.engine_models: set[str] = set()
        self.created = int(time.time())
        self._task: asyncio.Task[None] | None = None

    def resolve(self, model: str) -> Route:
        if model in self.engine_models or not self.engine_models:
            # An engine that could not list its models yet decides for itself.
            return Route(model, model, None)
        raise NotFound(
            f"The model `{model}` does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )

    def listed(self) -> list[str]:
        return sorted(self.engine_models)

    async def refresh(self) -> None:
        try:
            self.engine_models = set(await self.engine.list_models())
        except Exception as exc:
            log.warning("could not list the engine's models: %s", exc)

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._loop(), name="model-refresh")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()
