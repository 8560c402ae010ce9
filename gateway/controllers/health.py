"""Liveness and readiness probes."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Response, get
from litestar.di import NamedDependency

from gateway.engines.base import Engine
from storage.database import Database


class HealthController(Controller):
    @get("/healthz")
    async def healthz(self) -> dict[str, str]:
        """The process is up and serving HTTP."""
        return {"status": "ok"}

    @get("/readyz")
    async def readyz(
        self, database: NamedDependency[Database], engine: NamedDependency[Engine]
    ) -> Response[dict[str, Any]]:
        """200 when the gateway can serve calls, i.e. the engine answers; a load balancer routes on this.

        The database is reported but does not fail readiness: calls are served while it is down (capture
        spools to disk and replays), so pulling the gateway out of rotation would turn a degraded state
        into an outage."""
        ready = await engine.health()
        body = {
            "status": "ready" if ready else "not_ready",
            "engine": ready,
            "database": await database.ping(),
        }
        return Response(body, status_code=200 if ready else 503)
