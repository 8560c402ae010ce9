"""Liveness and readiness probes."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Response, get
from litestar.di import NamedDependency

from gateway.auth import KeyRing
from gateway.capture.sink import CaptureSink
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
        sink: NamedDependency[CaptureSink],
    ) -> Response[dict[str, Any]]:
        """200 when the gateway can serve calls: the engine answers, and the keys and policies were read once
        since start-up (until then calls are refused with 503); a load balancer routes on this.

        The database is reported but does not fail readiness once those were read: calls are served while it
        is down (capture spools to disk and replays), so pulling the gateway out of rotation would turn a
        degraded state into an outage. So is a capture log that cannot be written (`capture: memory`): calls
        are answered and held in memory. Only when the gateway refuses such calls (`capture_require_durable`,
        `capture: refusing`) is it not ready."""
        engine_up = await engine.health()
        capture = sink.state
        ready = engine_up and keys.loaded and router.policies_loaded and capture != "refusing"
        body = {
            "status": "ready" if ready else "not_ready",
            "engine": engine_up,
            "database": await database.ping(),
            "keys": keys.loaded,
            "policies": router.policies_loaded,
            "capture": capture,
        }
        return Response(body, status_code=200 if ready else 503)
