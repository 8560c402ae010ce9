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
        """The database and the engine answer; a load balancer should route here only when 200."""
        checks = {"database": await database.ping(), "engine": await engine.health()}
        ready = all(checks.values())
        return Response(
            {"status": "ready" if ready else "not_ready", **checks}, status_code=200 if ready else 503
        )
