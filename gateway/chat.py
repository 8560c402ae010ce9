"""The chat-completions service: validate, route, call the engine, normalise, capture.

This is the hot path. Its only I/O besides the engine call is one append to the capture log (a write to the OS,
no fsync); model resolution and episode stitching are in-memory lookups. The one exception is a follow-up turn
whose earlier turn this process does not know (another replica answered it): its conversation is looked up in
the database while the engine answers, and the answer waits at most `stitch_lookup_wait_ms` more for it.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from gateway.auth import Principal
from gateway.body_depth import refuse_too_deep
from gateway.capture.sink import CaptureSink
from gateway.engines.base import Engine, EngineStream, refuse_prompt_logprobs
from gateway.episodes import ConversationHashes, StitchCache, assign_episode, new_id, valid_id
from gateway.errors import APIError, CaptureUnavailable, InvalidRequest, PayloadTooLarge, PermissionDenied
from gateway.json_schemas import check_schema
from gateway.metrics import CallMetrics
from gateway.normalize import Captured, StreamAssembler, normalize_completion
from gateway.protocol import (
    AllowedToolsChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    FunctionTool,
    NamedCustomToolChoice,
    NamedToolChoice,
    ResponseFormatJsonSchema,
    tool_name,
)
from gateway.redaction import redact_call
from gateway.routing import ModelRouter, Route
from gateway.tracing import TRACE_HEADERS, CallTracer
from storage.calls import find_stitched_episode, recent_stitch_keys
from storage.database import Database
from storage.models import EPISODE_SOURCE_TRAFFIC, GROUP_KEY_LENGTH, USER_LENGTH
from storage.records import CallRecord, ResponseRecord

if TYPE_CHECKING:
    from gateway.shadow import ShadowTap

log = logging.getLogger(__name__)

_decode = msgspec.json.decode
_encode = msgspec.json.Encoder().encode
_PATH = re.compile(r"at `\$\.?(.*)`$")
# `X-Kaizen-Source`: what a tool that sends calls on purpose (not an app's traffic) names its episodes.
_SOURCE = re.compile(r"^[a-z][a-z0-9_.-]{0,31}$")
# Request fields stored under their own keys; everything else is kept under `params`.
_STORED_PARAMS = ("messages", "tools", "tool_choice")
# Database lookups of unknown follow-ups in flight at once; past it, calls are left to the capture writer.
_MAX_STITCH_LOOKUPS = 4


@dataclass
class CallContext:
    """Everything known about a call before the engine answers."""

    call_id: str
    client_request_id: str | None
    request: ChatCompletionRequest
    body: dict[str, Any]
    route: Route
    episode_id: str
    episode_resolved: bool
    hashes: ConversationHashes
    capture: bool
    started: float
    principal: Principal
    group_key: str | None = None
    source: str = EPISODE_SOURCE_TRAFFIC
    # The caller's tokens-per-window meter, when tokens are rate limited: charged with the call's usage.
    charge_tokens: Callable[[int], None] | None = None
    # For a `/v1/responses` call with `store`: given the captured reply of a served call, the response object
    # to store beside the call (already redacted: it goes to the capture log as it is).
    store_response: Callable[[Captured], ResponseRecord | None] | None = None
    # The app's trace context (`traceparent`, `tracestate`), kept only when calls are traced.
    trace_parent: dict[str, str] | None = None
    # The database lookup of an unknown follow-up's earlier turn, running while the engine answers.
    stitch_lookup: asyncio.Task[tuple[str, str] | None] | None = None
    # What keeps a user's (else a conversation's) calls on one side of a rollout's share: `user`, else the episode.
    sticky: str = ""


class EventSource(Protocol):
    """A stream assembler: normalises each engine chunk (None: send nothing) and knows when output began."""

    def feed(self, raw: Any) -> msgspec.Struct | None: ...

    @property
    def output_seen(self) -> bool: ...


class LastBatch(list[Any]):
    """The chunks that end a stream, given once the call is recorded: the relay sends them with the stream's
    final event."""

    __slots__ = ()


async def event_chunks(
    engine_stream: EngineStream,
    assembler: EventSource,
    started: float,
    finish: Callable[[str, APIError | None, float | None], None],
) -> AsyncGenerator[list[Any], None]:
    """The conformant chunks of an engine stream, in lists of those that arrived together (one write each for
    the relay, instead of one per chunk; nothing is held back waiting for the engine), the last a `LastBatch`
    (maybe empty). `finish(status, error, time to first output)` runs when they end: before the last batch is
    given, before an engine failure is raised to the consumer as `APIError`, and when the consumer closes the
    generator early (a client disconnect, where the partial reply counts)."""
    status, error, ttft = "client_disconnected", None, None
    batch: list[Any] = []
    finished = False
    try:
        async for raw in engine_stream:
            chunk = assembler.feed(raw)
            if chunk is not None:
                if ttft is None and assembler.output_seen:
                    ttft = time.perf_counter() - started
                batch.append(chunk)
            if batch and not engine_stream.ready():
                yield batch
                batch = []
        finished = True
        finish("ok", None, ttft)
        yield LastBatch(batch)
    except APIError as exc:
        status, error = "error", exc
        raise
    finally:
        await engine_stream.close()
        if not finished:
            finish(status, error, ttft)


class LastEvent(bytes):
    """A stream's final event (`[DONE]` or an error): the relay sends it with the end of the body, in one write."""

    __slots__ = ()


_DONE = b"data: [DONE]\n\n"


async def sse(chunks: AsyncGenerator[list[Any], None]) -> AsyncGenerator[bytes, None]:
    """Server-sent events of `event_chunks`: the call is recorded before the final event (`[DONE]`, or the
    error in OpenAI's shape) goes out, so a client that saw the end of its stream has a logged call."""
    try:
        async for batch in chunks:
            events = b"".join([b"data: " + _encode(chunk) + b"\n\n" for chunk in batch])
            if type(batch) is LastBatch:
                yield LastEvent(events + _DONE)
                return
            yield events
    except APIError as exc:
        yield LastEvent(b"data: " + _encode(exc.body()) + b"\n\n")
    finally:
        await chunks.aclose()


def relay_events(
    engine_stream: EngineStream,
    assembler: EventSource,
    started: float,
    finish: Callable[[str, APIError | None, float | None], None],
) -> AsyncGenerator[bytes, None]:
    """The SSE relay of an engine stream (`event_chunks` sent as `sse`)."""
    return sse(event_chunks(engine_stream, assembler, started, finish))


def _allowed_names(choice: AllowedToolsChoice) -> set[str]:
    """Names of `allowed_tools` references: `{"type": "function", "function": {"name"}}` (or `"name"` beside the
    type, as the Responses API writes it), and likewise for custom tools."""
    names = set()
    for ref in choice.allowed_tools.tools:
        inner = ref.get(str(ref.get("type")))
        name = inner.get("name") if isinstance(inner, dict) else ref.get("name")
        if isinstance(name, str):
            names.add(name)
    return names


def narrowed_tools(tools: list[Any], choice: AllowedToolsChoice) -> dict[str, Any]:
    """`allowed_tools` for an engine without it: the allowed tools alone under the choice's mode, the same
    constraint (the prompt then lists only those, which are all the model may call anyway)."""
    allowed = _allowed_names(choice)
    kept = [t for t in tools if (t.get(t.get("type")) or {}).get("name") in allowed]
    if not kept:
        return {"tools": None, "tool_choice": "none"}
    return {"tools": kept, "tool_choice": choice.allowed_tools.mode}


def validation_error(exc: msgspec.ValidationError) -> InvalidRequest:
    message = str(exc)
    match = _PATH.search(message)
    return InvalidRequest(message, param=match.group(1) if match else None, code="invalid_value")


class ChatService:
    def __init__(
        self,
        engine: Engine,
        router: ModelRouter,
        sink: CaptureSink,
        *,
        max_body_bytes: int,
        max_n: int,
        stitch_cache_size: int,
        metrics: CallMetrics | None = None,
        tracer: CallTracer | None = None,
        database: Database | None = None,
        stitch_lookup_wait_ms: float = 0.0,
        shadow: ShadowTap | None = None,
    ) -> None:
        self.engine = engine
        self.router = router
        self.sink = sink
        self.max_body_bytes = max_body_bytes
        self.max_n = max_n
        self.stitch = StitchCache(stitch_cache_size)
        self.metrics = metrics
        self.tracer = tracer
        self.database = database
        self.stitch_lookup_wait_s = stitch_lookup_wait_ms / 1000
        self.shadow = shadow
        self._lookups = 0  # stitch lookups in flight, capped so a burst cannot take the database pool
        # Calls captured with a provisional episode, until stored: their tails' stitch keys.
        self._provisional: dict[str, list[str]] = {}
        sink.on_stored = self._settle_stored

    async def warm(self, database: Database) -> None:
        """Load recent conversation tails so stitching survives a restart without a database lookup per call."""
        if self.stitch.size == 0:
            return
        try:
            async with database.session() as session:
                keys = await recent_stitch_keys(session, self.stitch.size)
        except Exception as exc:  # the gateway serves without a warm cache; the writer still stitches
            log.warning("could not warm the stitch cache: %s", exc)
            return
        for key, episode_id in keys:
            self.stitch.remember([key], episode_id)
        log.info("stitch cache warmed with %d conversation tails", len(keys))

    # ------------------------------------------------------------------ stitching across replicas
    def _start_lookup(self, lookup: list[str]) -> asyncio.Task[tuple[str, str] | None] | None:
        """Look an unknown follow-up's conversation up in the database, in the background; None when the
        database is known to be down or enough lookups are in flight (the writer resolves the call then)."""
        if self.database is None or self.stitch_lookup_wait_s <= 0 or not self.sink.database_up:
            return None
        if self._lookups >= _MAX_STITCH_LOOKUPS:
            return None
        self._lookups += 1
        task = asyncio.get_running_loop().create_task(self._lookup(lookup))
        task.add_done_callback(self._lookup_done)
        return task

    async def _lookup(self, lookup: list[str]) -> tuple[str, str] | None:
        assert self.database is not None
        async with self.database.session() as session:
            return await find_stitched_episode(session, lookup)

    def _lookup_done(self, task: asyncio.Task[tuple[str, str] | None]) -> None:
        """Remember what a lookup found, also when the call stopped waiting for it."""
        self._lookups -= 1
        if task.cancelled():
            return
        if task.exception() is not None:
            log.debug("stitch lookup failed: %s", task.exception())
            return
        found = task.result()
        if found is not None:
            self.stitch.remember([found[0]], found[1])

    async def _settle_episode(self, ctx: CallContext) -> None:
        """Take the database's answer for an unknown follow-up, if it comes within the wait."""
        task, ctx.stitch_lookup = ctx.stitch_lookup, None
        if task is None:
            return
        try:
            found = await asyncio.wait_for(asyncio.shield(task), self.stitch_lookup_wait_s)
        except Exception:  # timed out or failed: the capture writer resolves the call instead
            return
        if found is not None:
            ctx.episode_id, ctx.episode_resolved = found[1], True

    def _settle_stored(self, stored: list[tuple[str, str]]) -> None:
        """The writer stored these calls (call id, final episode id): settle the tails they registered."""
        for call_id, episode_id in stored:
            keys = self._provisional.pop(call_id, None)
            if keys is not None:
                self.stitch.settle(keys, episode_id)

    # ------------------------------------------------------------------ validation
    def prepare(self, raw_body: bytes, headers: Mapping[str, str], principal: Principal) -> CallContext:
        """Validate a request and decide where it goes. Raises `APIError` (4xx) and writes nothing on bad input."""
        try:
            ctx = self._prepare(raw_body, headers, principal)
        except APIError as exc:
            if self.metrics is not None:
                self.metrics.reject(exc.code)
            raise
        if self.tracer is not None:
            ctx.trace_parent = {name: headers[name] for name in TRACE_HEADERS if name in headers}
        return ctx

    def _prepare(self, raw_body: bytes, headers: Mapping[str, str], principal: Principal) -> CallContext:
        started = time.perf_counter()
        return self.prepare_body(self.decode_body(raw_body), headers, principal, started=started)

    def decode_body(self, raw_body: bytes) -> dict[str, Any]:
        """A request body as a JSON object, or the 4xx (503 while shutting down) that refuses it."""
        if self.sink.closing:
            raise APIError(
                "the gateway is shutting down; retry on another replica or after it restarts",
                status_code=503,
                code="shutting_down",
                retry_after=1.0,
            )
        if len(raw_body) > self.max_body_bytes:
            raise PayloadTooLarge(
                f"request body is {len(raw_body)} bytes; the limit is {self.max_body_bytes}",
                code="body_too_large",
            )
        try:
            body = _decode(raw_body)
        except msgspec.DecodeError as exc:
            raise InvalidRequest(f"could not parse the JSON body: {exc}", code="invalid_json") from exc
        if not isinstance(body, dict):
            raise InvalidRequest("the request body must be a JSON object", code="invalid_json")
        refuse_too_deep(body)
        return body

    def prepare_body(
        self,
        body: dict[str, Any],
        headers: Mapping[str, str],
        principal: Principal,
        *,
        started: float,
        continues: str | None = None,
    ) -> CallContext:
        """`prepare` for a decoded body (also the chat request a `/v1/responses` call is translated into).

        `continues`: the episode this call continues when the client names none (a `previous_response_id`)."""
        try:
            request = msgspec.convert(body, ChatCompletionRequest)
        except msgspec.ValidationError as exc:
            raise validation_error(exc) from exc
        self._check(request)
        if not self.engine.capabilities.prompt_logprobs:
            refuse_prompt_logprobs(body, echo_needs_logprobs=False)
        route = self.router.resolve(request.model)
        principal = self.router.admit(request.model, route, principal)
        if not principal.may_use(request.model, route.policy):
            raise PermissionDenied(
                f"This key may not use the model `{request.model}`.", param="model", code="model_not_allowed"
            )
        messages = body["messages"]
        # Conversations of different projects never stitch into one episode: the project seeds the hashes.
        hashes = ConversationHashes.of(messages, principal.project)
        header_episode = headers.get("x-episode-id")
        if header_episode is None and continues is not None and "episode_id" not in (request.metadata or {}):
            header_episode = continues
        episode = assign_episode(header_episode, request.metadata, hashes, self.stitch)
        sticky = request.user or episode.episode_id
        route = self.router.assign(route, principal, sticky)
        supplied = headers.get("x-request-id")
        group_key = (request.metadata or {}).get("group_key") or _group_key(headers.get("x-kaizen-group-key"))
        sent_source = headers.get("x-kaizen-source")
        source = EPISODE_SOURCE_TRAFFIC if sent_source is None else _source(sent_source, principal)
        capture = headers.get("x-kaizen-no-log", "").lower() not in ("true", "1", "yes")
        if capture and self.sink.refusing:  # strict capture, and the log cannot be written: before the engine
            raise CaptureUnavailable()
        lookup = None if episode.resolved else self._start_lookup(hashes.lookup)
        return CallContext(
            call_id=new_id(),
            client_request_id=supplied if supplied and valid_id(supplied) else None,
            request=request,
            body=body,
            route=route,
            episode_id=episode.episode_id,
            episode_resolved=episode.resolved,
            hashes=hashes,
            capture=capture,
            started=started,
            principal=principal,
            group_key=group_key,
            source=source,
            stitch_lookup=lookup,
            sticky=sticky,
        )

    def _check(self, request: ChatCompletionRequest) -> None:
        if request.n is not None and request.n > self.max_n:
            raise InvalidRequest(f"n={request.n} is above this gateway's limit of {self.max_n}", param="n")
        if request.top_logprobs is not None and not request.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
        if request.stream_options is not None and not request.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
        if request.tool_choice not in (None, "none", "auto") and not request.tools:
            raise InvalidRequest("tool_choice requires tools", param="tool_choice")
        names = [tool_name(t) for t in request.tools or []]
        if len(set(names)) != len(names):
            raise InvalidRequest("tool names must be unique", param="tools")
        for index, tool in enumerate(request.tools or []):
            if isinstance(tool, FunctionTool) and tool.function.parameters is not None:
                check_schema(
                    "function",
                    tool.function.name,
                    tool.function.parameters,
                    f"tools[{index}].function.parameters",
                )
        fmt = request.response_format
        if isinstance(fmt, ResponseFormatJsonSchema) and fmt.json_schema.schema is not None:
            check_schema(
                "response format",
                fmt.json_schema.name,
                fmt.json_schema.schema,
                "response_format.json_schema.schema",
            )
        choice = request.tool_choice
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        if isinstance(choice, NamedCustomToolChoice):
            named = choice.custom.name
        if named is not None and named not in names:
            raise InvalidRequest(f"tool_choice names `{named}`, which is not in tools", param="tool_choice")
        if isinstance(choice, AllowedToolsChoice) and not _allowed_names(choice) <= set(names):
            unknown = ", ".join(sorted(_allowed_names(choice) - set(names)))
            raise InvalidRequest(
                f"allowed_tools names tools that are not in tools: {unknown}",
                param="tool_choice.allowed_tools",
            )
        check_stored_fields(request.user, (request.metadata or {}).get("group_key"))

    # ------------------------------------------------------------------ engine call
    def _engine_body(self, ctx: CallContext) -> dict[str, Any]:
        body = dict(ctx.body)
        body["model"] = ctx.route.engine_model
        caps = self.engine.capabilities
        if caps.logprobs and not ctx.request.logprobs:
            body["logprobs"] = True
        if caps.token_ids:
            body["return_token_ids"] = True
        if ctx.request.stream:
            body["stream_options"] = {**(ctx.body.get("stream_options") or {}), "include_usage": True}
        if isinstance(ctx.request.tool_choice, AllowedToolsChoice) and not caps.allowed_tools:
            body.update(narrowed_tools(body.get("tools") or [], ctx.request.tool_choice))
        return body

    async def _acquire(self, ctx: CallContext) -> None:
        """Take a slot on the call's route; a refusal (e.g. overload) is the call's recorded outcome."""
        try:
            await self.router.acquire(ctx.route)
        except APIError as exc:
            self._record(ctx, None, status="error", error=exc, ttft=None)
            raise

    async def complete(self, ctx: CallContext) -> bytes:
        """Non-streamed call: the encoded conformant response, returned only once the call is durably logged."""
        return _encode(await self.answer(ctx))

    async def answer(self, ctx: CallContext) -> ChatCompletion:
        """`complete`, before encoding."""
        await self._acquire(ctx)
        try:
            raw = await self.engine.chat(self._engine_body(ctx))
            await self._settle_episode(ctx)
            completion, captured = normalize_completion(
                raw,
                response_id=f"chatcmpl-{ctx.call_id}",
                model=ctx.request.model,
                keep_logprobs=bool(ctx.request.logprobs),
            )
        except APIError as exc:
            self._record(ctx, None, status="error", error=exc, ttft=None)
            raise
        except asyncio.CancelledError:  # the client left before the reply (the controller cancels us)
            self._record(ctx, None, status="client_disconnected", error=None, ttft=None)
            raise
        finally:
            self.router.release(ctx.route)
        self._record(ctx, captured, status="ok", error=None, ttft=None)
        return completion

    async def stream(self, ctx: CallContext) -> AsyncGenerator[bytes, None]:
        """Open the engine stream (errors raise here, before any byte is sent) and return the SSE relay."""
        return sse(await self.stream_chunks(ctx))

    async def stream_chunks(self, ctx: CallContext) -> AsyncGenerator[list[ChatCompletionChunk], None]:
        """Open the engine stream (errors raise here) and return its conformant chunks, in lists of those that
        arrived together (`event_chunks`).

        The call is recorded when the chunks end: before the last list (a `LastBatch`) is given, before an engine
        failure is raised to the consumer as `APIError`, and when the consumer closes it early (a client
        disconnect)."""
        await self._acquire(ctx)
        try:
            engine_stream = await self.engine.open_stream(self._engine_body(ctx))
        except APIError as exc:
            self.router.release(ctx.route)
            self._record(ctx, None, status="error", error=exc, ttft=None)
            raise
        await self._settle_episode(ctx)  # before the headers go out: they name the episode
        include_usage = bool(ctx.request.stream_options and ctx.request.stream_options.include_usage)
        assembler = StreamAssembler(
            response_id=f"chatcmpl-{ctx.call_id}",
            model=ctx.request.model,
            keep_logprobs=bool(ctx.request.logprobs),
            keep_usage=include_usage,
        )

        def finish(status: str, error: APIError | None, ttft: float | None) -> None:
            self.router.release(ctx.route)
            self._record(ctx, assembler.captured(), status=status, error=error, ttft=ttft)

        return event_chunks(engine_stream, assembler, ctx.started, finish)

    # ------------------------------------------------------------------ capture
    def _record(
        self,
        ctx: CallContext,
        captured: Captured | None,
        *,
        status: str,
        error: APIError | None,
        ttft: float | None,
    ) -> None:
        """Count the call and capture it. Raises `CaptureUnavailable` for an answered call whose record the
        capture log cannot take when the gateway must refuse such calls (`capture_require_durable`)."""
        latency_s = time.perf_counter() - ctx.started
        stitch_keys: list[str] = []
        usage = captured.usage if captured is not None and captured.usage else None
        if ctx.charge_tokens is not None and usage is not None:
            ctx.charge_tokens(int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0))
        if captured is not None:
            stitch_keys = [ctx.hashes.continuation(c["message"]) for c in captured.response["choices"]]
            self.stitch.remember(stitch_keys, ctx.episode_id, settled=ctx.episode_resolved)
        stored_response = None
        if ctx.store_response is not None and captured is not None and status == "ok":
            stored_response = ctx.store_response(captured)
        refused = False
        if ctx.capture:
            refused = not self._capture(
                ctx, captured, stitch_keys, stored_response, status, error, latency_s, ttft
            )
        else:
            self.sink.opt_out()
        if self.metrics is not None:
            self.metrics.call(
                ctx.request.model,
                ctx.route.engine_model,
                "error" if refused else status,
                bool(ctx.request.stream),
                latency_s,
                ttft,
                int(usage.get("prompt_tokens") or 0) if usage is not None else 0,
                int(usage.get("completion_tokens") or 0) if usage is not None else 0,
            )
        if refused:
            raise CaptureUnavailable()
        if self.shadow is not None and captured is not None and status == "ok" and ctx.capture:
            self.shadow.offer(ctx, captured)  # a copy for a shadow rollout's candidate, answered later

    def _capture(
        self,
        ctx: CallContext,
        captured: Captured | None,
        stitch_keys: list[str],
        stored_response: ResponseRecord | None,
        status: str,
        error: APIError | None,
        latency_s: float,
        ttft: float | None,
    ) -> bool:
        """Submit the call's record to the capture sink; False when the call must be refused instead."""
        request = ctx.request
        params = {k: v for k, v in ctx.body.items() if k not in _STORED_PARAMS}
        record = CallRecord(
            id=ctx.call_id,
            client_request_id=ctx.client_request_id,
            episode_id=ctx.episode_id,
            episode_resolved=ctx.episode_resolved,
            stitch_lookup=ctx.hashes.lookup,
            stitch_keys=stitch_keys,
            policy=ctx.route.policy,
            model=request.model,
            adapter_version=ctx.route.adapter_version,
            engine_model=ctx.route.engine_model,
            stream=bool(request.stream),
            request={
                "messages": ctx.body["messages"],
                "tools": ctx.body.get("tools"),
                "tool_choice": ctx.body.get("tool_choice"),
                "params": params,
            },
            response=captured.response if captured else None,
            prompt_token_ids=captured.prompt_token_ids if captured else None,
            completion_token_ids=captured.completion_token_ids if captured else None,
            completion_logprobs=captured.completion_logprobs if captured else None,
            usage=captured.usage if captured else None,
            latency_ms=latency_s * 1000,
            ttft_ms=ttft * 1000 if ttft is not None else None,
            status=status,
            error={"status": error.status_code, "message": error.message, "code": error.code}
            if error
            else None,
            context_hash=ctx.hashes.context_hash,
            group_key=ctx.group_key,
            user=stored_user(request.user),
            episode_metadata=dict(request.metadata or {}),
            key_id=ctx.principal.key_id,
            project=ctx.principal.project,
            source=ctx.source,
            created_at=time.time(),
            stored_response=stored_response,
        )
        redactor = self.router.redactor(ctx.route.policy)
        if redactor is not None:  # before the capture log: nothing unredacted reaches the disk
            record = redact_call(record, redactor)
        if not self.sink.submit(record):
            return False
        if not ctx.episode_resolved and stitch_keys:
            if len(self._provisional) >= max(self.stitch.size, 1):
                self._provisional.clear()  # records that never reach the database must not pile up
            self._provisional[ctx.call_id] = stitch_keys
        if self.tracer is not None:  # built on the loop's next turn: the answer does not wait for it
            asyncio.get_running_loop().call_soon(self.tracer.record, record, ctx.trace_parent)
        return True


def check_stored_fields(user: object, group_key: object) -> None:
    """Refuse, before the engine is called, a `user` or group key the `calls` row cannot hold: they are stored
    in bounded text columns, which on PostgreSQL take no NUL and nothing longer than the column (the writer
    would have to drop the call that was answered). A longer `user` (the spec sets no limit) is served and
    kept to its first `USER_LENGTH` characters instead (`stored_user`); a group key is Kaizen's own, and
    documented as at most `GROUP_KEY_LENGTH`. Content and metadata are JSON, stored losslessly."""
    if isinstance(user, str) and "\x00" in user:
        raise InvalidRequest("user must not contain NUL characters", param="user", code="invalid_value")
    if isinstance(group_key, str) and ("\x00" in group_key or len(group_key) > GROUP_KEY_LENGTH):
        raise InvalidRequest(
            f"metadata.group_key must be at most {GROUP_KEY_LENGTH} characters, without NUL characters",
            param="metadata.group_key",
            code="invalid_value",
        )


def stored_user(user: object) -> str | None:
    """The `user` a calls row keeps: the first `USER_LENGTH` characters of the request's."""
    return user[:USER_LENGTH] if isinstance(user, str) else None


def _group_key(value: str | None) -> str | None:
    """`X-Kaizen-Group-Key`, for clients that set headers more easily than `metadata` (agent frameworks)."""
    if value is None:
        return None
    if not 0 < len(value) <= GROUP_KEY_LENGTH or "\x00" in value:
        raise InvalidRequest(
            f"X-Kaizen-Group-Key must be 1-{GROUP_KEY_LENGTH} characters without NUL",
            code="invalid_group_key",
        )
    return value


def _source(value: str, principal: Principal) -> str:
    """`X-Kaizen-Source`: only an admin key may say its calls are not traffic (a bootstrap run, an import), so
    an app cannot make its own traffic look like curated data."""
    if "admin" not in principal.scopes:
        raise PermissionDenied(
            "X-Kaizen-Source may only be sent with a key that has the admin scope", code="source_not_allowed"
        )
    if not _SOURCE.match(value):
        raise InvalidRequest(
            "X-Kaizen-Source must be 1-32 characters: a lower-case letter, then letters, digits, '_', '.' or '-'",
            code="invalid_source",
        )
    return value
