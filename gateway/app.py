"""The Litestar application: wiring of settings, database, engine, capture and controllers."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from litestar import Litestar, Request, Response, Router
from litestar.datastructures import State
from litestar.di import Provide
from litestar.exceptions import HTTPException, NotFoundException, ValidationException

from gateway.auth import KeyRing, require_api_key
from gateway.capture import CaptureSink
from gateway.chat import ChatService
from gateway.controllers.admin import CaptureAdminController
from gateway.controllers.chat import ChatController
from gateway.controllers.health import HealthController
from gateway.controllers.models import ModelsController
from gateway.engines.base import Engine
from gateway.errors import APIError
from gateway.protocol import ErrorBody, ErrorResponse
from gateway.routing import ModelRouter
from gateway.settings import Settings
from storage.database import Database

log = logging.getLogger(__name__)


@dataclass
class Services:
    """Long-lived objects of one gateway process, built at start-up and injected into handlers."""

    settings: Settings
    database: Database
    engine: Engine
    router: ModelRouter
    sink: CaptureSink
    chat: ChatService


def build_engine(settings: Settings) -> Engine:
    if settings.engine == "upstream":
        from gateway.engines.upstream import UpstreamEngine

        return UpstreamEngine(settings)
    raise ValueError(f"engine {settings.engine!r} is not available in this build")


def build_services(settings: Settings, engine: Engine | None = None) -> Services:
    database = Database(settings.database_url)
    engine = engine or build_engine(settings)
    router = ModelRouter(engine, settings.models_refresh_s)
    sink = CaptureSink(
        database,
        settings.spool_path,
        queue_size=settings.capture_queue_size,
        batch_size=settings.capture_batch_size,
        flush_ms=settings.capture_flush_ms,
        retry_s=settings.capture_retry_s,
    )
    chat = ChatService(
        engine,
        router,
        sink,
        max_body_bytes=settings.max_body_bytes,
        max_n=settings.max_n,
        stitch_cache_size=settings.stitch_cache_size,
    )
    return Services(settings, database, engine, router, sink, chat)


def _error(status: int, message: str, error_type: str, code: str | None) -> Response[ErrorResponse]:
    return Response(ErrorResponse(ErrorBody(message, error_type, None, code)), status_code=status)


def _api_error(_: Request[Any, Any, Any], exc: APIError) -> Response[ErrorResponse]:
    return exc.to_response()


def _http_error(_: Request[Any, Any, Any], exc: HTTPException) -> Response[ErrorResponse]:
    status = exc.status_code
    if isinstance(exc, NotFoundException):
        return _error(404, "Unknown route.", "invalid_request_error", "not_found")
    if isinstance(exc, ValidationException):
        return _error(400, str(exc.detail), "invalid_request_error", "invalid_value")
    if status == 413:
        return _error(413, "Request body too large.", "invalid_request_error", "body_too_large")
    if status == 405:
        return _error(405, "Method not allowed.", "invalid_request_error", "method_not_allowed")
    kind = "invalid_request_error" if status < 500 else "api_error"
    return _error(status, str(exc.detail), kind, None)


def _internal_error(request: Request[Any, Any, Any], exc: Exception) -> Response[ErrorResponse]:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return _error(500, "Internal error in the gateway.", "api_error", "internal_error")


def create_app(services: Services) -> Litestar:
    """Build the app around already-constructed services (tests pass their own engine)."""
    settings = services.settings

    @asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        await services.engine.start()
        await services.sink.start()
        await services.router.start()
        await services.chat.warm(services.database)
        try:
            yield
        finally:
            await services.router.stop()
            await services.sink.stop()
            await services.engine.close()
            await services.database.dispose()

    v1 = Router(path="/v1", route_handlers=[ChatController, ModelsController], guards=[require_api_key])
    return Litestar(
        route_handlers=[v1, HealthController, CaptureAdminController],
        dependencies={
            "chat": Provide(lambda: services.chat, sync_to_thread=False, use_cache=True),
            "router": Provide(lambda: services.router, sync_to_thread=False, use_cache=True),
            "sink": Provide(lambda: services.sink, sync_to_thread=False, use_cache=True),
            "database": Provide(lambda: services.database, sync_to_thread=False, use_cache=True),
            "engine": Provide(lambda: services.engine, sync_to_thread=False, use_cache=True),
        },
        state=State({"api_keys": KeyRing(settings.api_keys), "admin_key": KeyRing([settings.admin_key])}),
        exception_handlers={
            APIError: _api_error,
            HTTPException: _http_error,
            Exception: _internal_error,
        },
        lifespan=[lifespan],
        request_max_body_size=settings.max_body_bytes,
        openapi_config=None,
        debug=False,
    )
