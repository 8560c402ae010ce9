"""The Litestar application: wiring of settings, database, engine, capture and controllers."""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from litestar import Litestar, Request, Response, Router
from litestar.datastructures import State
from litestar.di import NamedDependency, Provide
from litestar.exceptions import HTTPException, NotFoundException, ValidationException
from litestar.handlers import asgi
from litestar.template.config import TemplateConfig
from litestar.types import ASGIApp, Receive, Scope, Send
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.auth import KeyRing, LoginThrottle, requires
from gateway.capture.sink import CaptureSink
from gateway.chat import ChatService
from gateway.completions import RelayService
from gateway.controllers.admin import (
    AuditController,
    CaptureAdminController,
    EngineAdminController,
    KeysController,
)
from gateway.controllers.chat import ChatController, ChatRoute, chat_route_first
from gateway.controllers.completions import CompletionsController, EmbeddingsController
from gateway.controllers.episodes import EpisodesController
from gateway.controllers.feedback import FeedbackController
from gateway.controllers.health import HealthController
from gateway.controllers.metrics import MetricsController
from gateway.controllers.models import ModelsController
from gateway.controllers.policies import PoliciesController
from gateway.controllers.policy_actions import PolicyActions
from gateway.controllers.responses import ResponsesController
from gateway.controllers.rollouts import RolloutsController
from gateway.controllers.runs import RunsController
from gateway.engines.base import Engine
from gateway.errors import APIError, Conflict, InternalError, undecodable_body
from gateway.exposure import cors_config, json_bodies_only, loopback_hosts_only
from gateway.feedback import FeedbackService
from gateway.mcp import PATH as MCP_PATH
from gateway.mcp import McpEndpoint, PolicyTools, requires_policy_tools
from gateway.metrics import GatewayMetrics, count_responses
from gateway.peers import PeerLink, WorkerPeers
from gateway.protocol import ErrorBody, ErrorResponse
from gateway.rate_limits import limiter_from_settings, rate_limit_middleware
from gateway.redaction import load_redaction_key
from gateway.responses.service import ResponsesService
from gateway.responses.store import ResponseStore
from gateway.routing import ModelRouter
from gateway.scheduling import Jobs
from gateway.settings import Settings
from gateway.shadow import ShadowTap
from gateway.tracing import CallTracer, build_tracer
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
    responses: ResponsesService
    relay: RelayService
    feedback: FeedbackService
    jobs: Jobs
    keys: KeyRing
    mcp: McpEndpoint
    metrics: GatewayMetrics | None = None
    tracer: CallTracer | None = None
    shadow: ShadowTap | None = None
    peers: PeerLink | None = None  # as one of several serving workers


def build_engine(settings: Settings) -> Engine:
    if settings.engine == "upstream":
        from gateway.engines.upstream import UpstreamEngine

        return UpstreamEngine(settings)
    return build_vllm_engine(settings)


def build_vllm_engine(settings: Settings, *, adopt_adapters: bool = False) -> Engine:
    """The vLLM engine: attached by URL, or supervised servers for the (pulled if embedded) base model; several
    URLs or `vllm_replicas` > 1 make a pool that balances calls over them. `adopt_adapters`: started servers are
    shared with attached serving workers, whose adapters a restart must re-load."""
    from gateway.base_models import EMBEDDED_MODELS, resolve_base_model, served_model_name
    from gateway.engines.pool import EnginePool
    from gateway.engines.vllm import VLLMEngine, VLLMLaunch, find_vllm_python, free_loopback_port
    from gateway.tool_call_parsers import choose_tool_call_parser

    served = served_model_name(settings.base_model)
    common = {
        "served_name": served,
        "timeout_s": settings.engine_timeout_s,
        "connect_timeout_s": settings.engine_connect_timeout_s,
        "max_connections": settings.engine_max_connections,
        "startup_timeout_s": settings.vllm_startup_timeout_s,
    }
    urls = settings.vllm_urls
    if urls:
        attached = [VLLMEngine(base_url=url, launch=None, **common) for url in urls]  # type: ignore[arg-type]
        return attached[0] if len(attached) == 1 else EnginePool(attached)
    embedded = EMBEDDED_MODELS.get(settings.base_model)
    count = settings.vllm_replicas
    model = resolve_base_model(settings.base_model, settings.data_dir / "models")
    tool_call_parser = choose_tool_call_parser(
        settings.vllm_tool_call_parser or (embedded.tool_call_parser if embedded else ""),
        model,
        settings.vllm_chat_template,
    )
    replicas = []
    for index in range(count):
        # Port 0: a port no other gateway's vLLM holds; a fixed port is the first replica's, the next ones follow.
        port = settings.vllm_port + index if settings.vllm_port else free_loopback_port()
        launch = VLLMLaunch(
            python=find_vllm_python(settings.vllm_python),
            model=model,
            served_name=served,
            port=port,
            max_model_len=settings.vllm_max_model_len,
            max_loras=settings.vllm_max_loras,
            max_lora_rank=settings.vllm_max_lora_rank,
            kv_cache_gib=settings.vllm_kv_cache_gib,
            dtype=settings.vllm_dtype,
            tool_call_parser=tool_call_parser,
            tool_strict_level=settings.vllm_tool_strict_level,
            chat_template=settings.vllm_chat_template or None,
            extra_args=settings.vllm_extra_args.split(),
            env=replica_environment(settings, index),
        )
        log_name = "vllm.log" if count == 1 else f"vllm-{index}.log"
        replicas.append(
            VLLMEngine(
                base_url=f"http://127.0.0.1:{port}/v1",
                launch=launch,
                log_path=settings.data_dir / "logs" / log_name,
                adopt_adapters=adopt_adapters,
                **common,  # type: ignore[arg-type]
            )
        )
    return replicas[0] if count == 1 else EnginePool(replicas)


def replica_environment(settings: Settings, index: int) -> dict[str, str]:
    """The devices of started replica `index`: its GPUs (one each by default when there are several; a single one
    sees every GPU unless told) and, on CPU, its cores."""
    env: dict[str, str] = {}
    gpus = [g.strip() for g in settings.vllm_replica_gpus.split(";")] if settings.vllm_replica_gpus else []
    if index < len(gpus):
        env["CUDA_VISIBLE_DEVICES"] = gpus[index]
    elif settings.vllm_replicas > 1:
        env["CUDA_VISIBLE_DEVICES"] = str(index)
    cpus = [c.strip() for c in settings.vllm_replica_cpus.split(";")] if settings.vllm_replica_cpus else []
    if index < len(cpus):
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpus[index]
    return env


def engine_url(engine: Engine) -> str | None:
    """The /v1 URL of a vLLM engine (the port it really uses), for putting it to sleep during training. A pool
    of replicas has none: sleeping is for one GPU shared by serving and training."""
    from gateway.engines.vllm import VLLMEngine

    return engine.base_url if isinstance(engine, VLLMEngine) else None


def engine_urls(engine: Engine) -> list[str]:
    """The /v1 URLs of the vLLM server(s) `build_vllm_engine` started, for serving workers to attach to."""
    from gateway.engines.pool import EnginePool
    from gateway.engines.vllm import VLLMEngine

    if isinstance(engine, EnginePool):
        return engine.urls()
    assert isinstance(engine, VLLMEngine)
    return [engine.base_url]


def build_services(
    settings: Settings, engine: Engine | None = None, workers: WorkerPeers | None = None
) -> Services:
    """Everything one gateway process serves with; `workers` when it is one of several serving workers."""
    database = Database(settings.database_url)
    engine = engine or build_engine(settings)
    router = ModelRouter(
        engine,
        settings.models_refresh_s,
        database=database,
        policy_refresh_s=settings.policy_refresh_s,
        idle_unload_s=settings.adapter_idle_unload_s,
        redaction_key=lambda: load_redaction_key(settings.redaction_key, settings.data_dir),
    )
    sink = CaptureSink(
        settings.database_url,
        settings.capture_log_dir,
        batch_size=settings.capture_batch_size,
        flush_ms=settings.capture_flush_ms,
        retry_s=settings.capture_retry_s,
        fsync_ms=settings.capture_fsync_ms,
        segment_bytes=settings.capture_segment_bytes,
        drain_timeout_s=settings.capture_drain_timeout_s,
        stitch_grace_ms=settings.stitch_grace_ms,
        memory_limit_bytes=settings.capture_memory_bytes,
        require_durable=settings.capture_require_durable,
    )
    peers = PeerLink(workers) if workers is not None else None
    if peers is not None:
        sink.answer_peers(peers)
    # Only an engine that serves adapters has versions to shadow.
    shadow = (
        ShadowTap(
            engine,
            router,
            database,
            queue_size=settings.shadow_queue,
            concurrency=settings.shadow_concurrency,
        )
        if engine.capabilities.adapters and settings.shadow_queue > 0
        else None
    )
    metrics = (
        GatewayMetrics(
            settings, database=database, engine=engine, router=router, sink=sink, peers=peers, shadow=shadow
        )
        if settings.metrics
        else None
    )
    tracer = build_tracer(settings)
    chat = ChatService(
        engine,
        router,
        sink,
        max_body_bytes=settings.max_body_bytes,
        max_n=settings.max_n,
        stitch_cache_size=settings.stitch_cache_size,
        metrics=metrics.calls if metrics is not None else None,
        tracer=tracer,
        database=database,
        stitch_lookup_wait_ms=settings.stitch_lookup_wait_ms,
        shadow=shadow,
    )
    responses = ResponsesService(
        chat,
        ResponseStore(
            database,
            cache_size=settings.responses_cache_size,
            read_wait_s=settings.responses_read_wait_s,
            recheck_s=settings.responses_recheck_s,
        ),
    )
    relay = RelayService(
        engine,
        router,
        sink,
        chat,
        capture_embeddings=settings.capture_embeddings,
    )
    keys = KeyRing(settings.api_keys, settings.admin_key)
    feedback = FeedbackService(
        database,
        sink.recent,
        keys,
        secret=settings.feedback_secret,
        tolerance_s=settings.feedback_tolerance_s,
        grace_s=settings.feedback_grace_s,
        link_interval_s=settings.feedback_link_interval_s,
        redactor=router.redactor,
        on_stored=metrics.calls.feedback_items if metrics is not None else None,
    )
    jobs = Jobs(settings, database, schedule=settings.scheduler, engine_url=engine_url(engine))
    mcp = McpEndpoint(database, PolicyTools(database, settings.policy_refresh_s), router.current_redactor)
    return Services(
        settings,
        database,
        engine,
        router,
        sink,
        chat,
        responses,
        relay,
        feedback,
        jobs,
        keys,
        mcp,
        metrics,
        tracer,
        shadow,
        peers,
    )


async def provide_session(database: NamedDependency[Database]) -> AsyncIterator[AsyncSession]:
    """A handler's session, in one transaction: committed when the handler succeeds, rolled back when it raises.

    The commit runs after the handler returned and before the response goes out, so a client never sees an
    answer for a write that did not happen; a unique-key clash there is answered by `integrity_conflict`.
    """
    async with database.session() as session:
        try:
            yield session
        except BaseException:
            await session.rollback()
            raise
        await session.commit()


def _error(status: int, message: str, error_type: str, code: str | None) -> Response[ErrorResponse]:
    return Response(ErrorResponse(ErrorBody(message, error_type, None, code)), status_code=status)


def _api_error(_: Request[Any, Any, Any], exc: APIError) -> Response[ErrorResponse]:
    return exc.to_response()


def integrity_conflict(_: Request[Any, Any, Any], exc: IntegrityError) -> Response[ErrorResponse]:
    # Mapped here rather than in `provide_session`: Litestar wraps an exception a dependency raises while
    # cleaning up after a failed handler in an ExceptionGroup, which no handler of ours would match.
    log.info("unique or foreign key conflict: %s", exc.orig)
    return Conflict("the request conflicts with stored data", code="conflict").to_response()


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


def _undecodable_body(
    request: Request[Any, Any, Any], exc: RecursionError | UnicodeDecodeError
) -> Response[ErrorResponse]:
    """The JSON decoders (ours, Litestar's, the feedback parser's) raise these two for bodies that are nested
    deeper than the interpreter's stack or hold invalid UTF-8: the client's fault, so a 400, on every route."""
    log.info("undecodable body on %s %s: %s", request.method, request.url.path, type(exc).__name__)
    return undecodable_body(exc).to_response()


def _database_error(request: Request[Any, Any, Any], exc: Exception) -> Response[ErrorResponse]:
    """The database is down or locked: the request may succeed later, so 503 with Retry-After, not 500.
    Calls keep being served meanwhile (capture spools); only routes that read or write the database fail.
    A value the database refuses (SQLSTATE class 22) is the request's fault: 400."""
    if isinstance(exc, DBAPIError) and _sqlstate(exc).startswith("22"):
        # SQL "data exception" (e.g. a NUL byte in text, which PostgreSQL cannot store): the input's fault.
        log.info("refused value on %s %s: %s", request.method, request.url.path, exc.orig)
        return _error(
            400, "A value in the request cannot be stored.", "invalid_request_error", "invalid_value"
        )
    if isinstance(exc, DBAPIError) and not _is_connection_error(exc):
        return _internal_error(request, exc)
    log.warning("database unavailable on %s %s: %s", request.method, request.url.path, exc)
    response = _error(503, "The database is unavailable; retry later.", "api_error", "database_unavailable")
    response.headers["retry-after"] = str(DATABASE_RETRY_AFTER_S)
    return response


DATABASE_RETRY_AFTER_S = 5


def _sqlstate(exc: DBAPIError) -> str:
    """The PostgreSQL SQLSTATE of a driver error ('' for SQLite and for errors without one)."""
    code = getattr(exc.orig, "pgcode", None) or getattr(exc.orig, "sqlstate", None)
    return code if isinstance(code, str) else ""


def _is_connection_error(exc: DBAPIError) -> bool:
    """Connection loss, refused connections and SQLite's lock timeouts, as opposed to bad SQL or constraints."""
    if exc.connection_invalidated:
        return True
    original = exc.orig
    if isinstance(original, OSError | ConnectionError):
        return True
    text = str(original).lower()
    return any(
        marker in text
        for marker in (
            "database is locked",
            "connection",
            "could not connect",
            "server closed",
            "shutting down",
        )
    )


def _internal_error(request: Request[Any, Any, Any], exc: Exception) -> Response[ErrorResponse]:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return InternalError().to_response()


def create_app(services: Services) -> Litestar:
    """Build the app around already-constructed services (tests pass their own engine)."""
    settings = services.settings

    @asgi(MCP_PATH, is_mount=True, copy_scope=True, guards=[requires_policy_tools(services.database)])
    async def mcp_mount(scope: Scope, receive: Receive, send: Send) -> None:
        """`/mcp/<policy>`: the policy's tools as an MCP server (`gateway.mcp`)."""
        await services.mcp.handle(scope, receive, send)

    @asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        await services.engine.start()
        await services.sink.start()
        await services.keys.start(services.database, settings.policy_refresh_s)
        await services.router.start()
        if services.shadow is not None:
            await services.shadow.start()
        await services.chat.warm(services.database)
        await services.feedback.start()
        await services.jobs.start()
        if services.peers is not None:
            await services.peers.start()
        # Everything alive now lives as long as the process: moving it out of the collector's reach keeps
        # full collections short (measured: 45-120 ms stalls of every in-flight call without this).
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            if services.peers is not None:
                await services.peers.stop()
            await services.mcp.stop()
            await services.jobs.stop()
            await services.feedback.stop()
            if services.shadow is not None:  # before the router: its copies hold adapters in flight
                await services.shadow.stop()
            await services.router.stop()
            await services.keys.stop()
            await services.sink.stop()
            if services.tracer is not None:  # the last calls' spans go out before the process ends
                services.tracer.shutdown()
            await services.engine.close()
            await services.database.dispose()

    # Each controller's guard names the scope it needs (`gateway.auth.requires`). The rate limiter is attached
    # only when a limit is set (admin and feedback routes are outside /v1's router: never limited).
    limiter = limiter_from_settings(settings)
    v1 = Router(
        path="/v1",
        route_handlers=[
            ChatController,
            ResponsesController,
            CompletionsController,
            EmbeddingsController,
            ModelsController,
            EpisodesController,
        ],
        middleware=[rate_limit_middleware(limiter, services.keys)] if limiter.enabled else [],
    )
    # The policy actions are declared once and registered here and under the dashboard's router.
    admin = Router(path="/admin", route_handlers=[PolicyActions], guards=[requires("admin")])
    state: dict[str, Any] = {
        "key_ring": services.keys,
        # Failed logins with the admin key (dashboard, /admin, /metrics), counted together per client address.
        "login_throttle": LoginThrottle(settings.dashboard_login_failures, settings.dashboard_login_window_s),
    }
    dashboard: list[Router] = []
    templates: TemplateConfig[Any] | None = None
    if settings.dashboard:
        # Imported only when served: the templates engine is not needed otherwise.
        from gateway.dashboard import dashboard_routers, dashboard_state, template_config

        dashboard = dashboard_routers()
        templates = template_config()
        state.update(dashboard_state(settings))
    app = Litestar(
        route_handlers=[
            v1,
            FeedbackController,
            HealthController,
            CaptureAdminController,
            EngineAdminController,
            KeysController,
            AuditController,
            PoliciesController,
            RolloutsController,
            RunsController,
            admin,
            mcp_mount,
            *([MetricsController] if services.metrics is not None else []),
            *dashboard,
        ],
        dependencies={
            "chat": Provide(lambda: services.chat, sync_to_thread=False, use_cache=True),
            "responses": Provide(lambda: services.responses, sync_to_thread=False, use_cache=True),
            "relay": Provide(lambda: services.relay, sync_to_thread=False, use_cache=True),
            "router": Provide(lambda: services.router, sync_to_thread=False, use_cache=True),
            "sink": Provide(lambda: services.sink, sync_to_thread=False, use_cache=True),
            "database": Provide(lambda: services.database, sync_to_thread=False, use_cache=True),
            "session": Provide(provide_session),
            "engine": Provide(lambda: services.engine, sync_to_thread=False, use_cache=True),
            "settings": Provide(lambda: services.settings, sync_to_thread=False, use_cache=True),
            "feedback": Provide(lambda: services.feedback, sync_to_thread=False, use_cache=True),
            "jobs": Provide(lambda: services.jobs, sync_to_thread=False, use_cache=True),
            "keys": Provide(lambda: services.keys, sync_to_thread=False, use_cache=True),
            "metrics": Provide(lambda: services.metrics, sync_to_thread=False, use_cache=True),
        },
        state=State(state),
        template_config=templates,
        exception_handlers={
            APIError: _api_error,
            IntegrityError: integrity_conflict,
            HTTPException: _http_error,
            RecursionError: _undecodable_body,
            UnicodeDecodeError: _undecodable_body,
            DBAPIError: _database_error,
            PoolTimeout: _database_error,
            ConnectionError: _database_error,
            Exception: _internal_error,
        },
        lifespan=[lifespan],
        middleware=[
            *([count_responses(services.metrics.calls)] if services.metrics is not None else []),
            loopback_hosts_only(settings, services.keys),
            json_bodies_only,
        ],
        cors_config=cors_config(settings),
        request_max_body_size=settings.max_body_bytes,
        openapi_config=None,
        debug=False,
    )
    # The chat route runs outside Litestar's router, wrapped in the same middleware, outermost first.
    chat: ASGIApp = ChatRoute(services.chat, services.keys, settings.max_body_bytes)
    if limiter.enabled:
        chat = rate_limit_middleware(limiter, services.keys, spends_tokens=lambda _: True)(chat)
    chat = json_bodies_only(chat)
    chat = loopback_hosts_only(settings, services.keys)(chat)
    if services.metrics is not None:
        chat = count_responses(services.metrics.calls)(chat)
    app.asgi_handler = chat_route_first(chat, app.asgi_handler, cors=bool(settings.cors_origins))
    return app
