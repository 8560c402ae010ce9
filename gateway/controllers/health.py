"""Liveness and readiness probes."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Response, get
from litestar.di import NamedDependency

from gateway.auth import KeyRing
from gateway.engines.base import Engine
from gateway.routing import ModelRouter
from storage.database import Database


class HealthController(Controller):
    @get("/healthz")
    async def healthz(self) -> dict[str, str]:
        """The process is up and serving HTTP."""
        return {"status": "ok"}

    @get("/readyz")
    async def readyz(
        self,
        database: NamedDependency[Database],
        engine: NamedDependency[Engine],
        router: NamedDependency[ModelRouter],
        keys: NamedDependency[KeyRing],
    ) -> Response[dict[str, Any]]:
        """200 when the gateway can serve calls: the engine answers, and the keys and policies were read once
        since start-up (until then calls are refused with 503); a load balancer routes on this.

        The database is reported but does not fail readiness once those were read: calls are served while it
        is down (capture spools to disk and replays), so pulling the gateway out of rotation would turn a
        degraded state into an outage."""
        engine_up = await engine.health()
        ready = engine_up and keys.loaded and router.policies_loaded
        body = {
            "status": "ready" if ready else "not_ready",
            "engine": engine_up,
            "database": await database.ping(),
            "keys": keys.loaded,
            "policies": router.policies_loaded,
        }
        return Response(body, status_code=200 if ready else 503)
