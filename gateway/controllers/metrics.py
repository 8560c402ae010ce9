"""`GET /metrics`: Prometheus metrics (registered only when `KAIZEN_METRICS` is on)."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, Response, get
from litestar.di import NamedDependency

from gateway.auth import KeyRing, LoginThrottle, client_address, counted_lookup, refuse_throttled
from gateway.errors import AuthenticationError
from gateway.metrics import GatewayMetrics


class MetricsController(Controller):
    path = "/metrics"

    @get("")
    async def scrape(
        self,
        request: Request[Any, Any, Any],
        metrics: NamedDependency[GatewayMetrics],
        keys: NamedDependency[KeyRing],
    ) -> Response[bytes]:
        """The exposition Prometheus scrapes: the metrics key or an admin key (a wrong one counts as a failed
        login, like a wrong admin key on /admin); open only on a gateway with no key at all."""
        if not metrics.open_with(keys):
            authorization = request.headers.get("authorization")
            throttle: LoginThrottle = request.app.state.login_throttle
            address = client_address(request)
            refuse_throttled(throttle, address)  # the metrics key's answer too: no oracle for it either
            if not metrics.has_key(authorization):
                principal = counted_lookup(keys, throttle, address, authorization)
                if principal is None or "admin" not in principal.scopes:
                    raise self.refused()
        await metrics.refresh()
        body, content_type = await metrics.render(request.headers.get("accept", ""))
        return Response(body, media_type=content_type)

    @staticmethod
    def refused() -> AuthenticationError:
        return AuthenticationError(
            "Missing or invalid key for /metrics: send `Authorization: Bearer <KAIZEN_METRICS_KEY>`.",
            code="invalid_metrics_key",
        )
