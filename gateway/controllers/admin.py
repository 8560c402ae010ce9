"""Admin routes (admin key required)."""

from __future__ import annotations

from typing import Any

from litestar import Controller, get
from litestar.di import NamedDependency

from gateway.auth import require_admin_key
from gateway.capture import CaptureSink


class CaptureAdminController(Controller):
    path = "/admin/capture"
    guards = [require_admin_key]  # noqa: RUF012

    @get("")
    async def capture_stats(self, sink: NamedDependency[CaptureSink]) -> dict[str, Any]:
        """Counters of the capture path: queued, written, spooled, replayed, dropped, opted out."""
        return sink.snapshot()
