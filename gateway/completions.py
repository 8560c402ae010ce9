"""The relayed routes besides chat: legacy text completions (captured) and embeddings (captured on request).

A text completion is a trajectory of one turn: the prompt, exactly as sent (no chat template), and the sampled
text with its token ids and behaviour logprobs. It is its own episode unless the client names one
(`X-Episode-Id`, `metadata.episode_id`): a prompt is free text, so there is no message boundary to stitch on.
Embeddings have no sampled tokens to learn from, so they are stored only with `KAIZEN_CAPTURE_EMBEDDINGS`
(the input and usage, never the vectors).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from gateway.auth import Principal
from gateway.capture.sink import CaptureSink
from gateway.chat import ChatService, check_stored_fields, relay_events, stored_user, validation_error
from gateway.engines.base import Engine, refuse_prompt_logprobs
from gateway.episodes import ConversationHashes, assign_episode, new_id, valid_id
from gateway.errors import APIError, CaptureUnavailable, InvalidRequest, PermissionDenied
from gateway.normalize import Captured, TextStreamAssembler, normalize_embeddings, normalize_text_completion
from gateway.protocol import CompletionRequest, EmbeddingRequest, uniform_items
from gateway.redaction import redact_call
from gateway.routing import ModelRouter, Route
from storage.records import CallRecord

_encode = msgspec.json.Encoder().encode
_Request = TypeVar("_Request", CompletionRequest, EmbeddingRequest)


@dataclass
class RelayContext:
    """A validated call to a relayed route, before the engine answers."""

    call_id: str
    client_request_id: str | None
    body: dict[str, Any]
    route: Route
    model: str
    episode_id: str
    context_hash: str
    capture: bool
    started: float
    principal: Principal
    stream: bool = False
    keep_logprobs: bool = False
    keep_usage: bool = False
    echo: bool = False
    charge_tokens: Callable[[int], None] | None = None


class RelayService:
    """`/v1/completions` and `/v1/embeddings` through the chat service's engine, router and capture sink."""

    def __init__(
        self,
        engine: Engine,
        router: ModelRouter,
        sink: CaptureSink,
        chat: ChatService,
        *,
        capture_embeddings: bool,
    ) -> None:
        self.engine = engine
        self.router = router
        self.sink = sink
        self.chat = chat
        self.capture_embeddings = capture_embeddings

    # ------------------------------------------------------------------ validation
    def _parse(self, raw_body: bytes, kind: type[_Request]) -> tuple[dict[str, Any], _Request]:
        body = self.chat.decode_body(raw_body)
        try:
            return body, msgspec.convert(body, kind)
        except msgspec.ValidationError as exc:
            raise validation_error(exc) from exc

    def _context(
        self,
        body: dict[str, Any],
        model: str,
        headers: Mapping[str, str],
        principal: Principal,
        metadata: Mapping[str, str] | None,
        started: float,
    ) -> RelayContext:
        check_stored_fields(body.get("user"), (metadata or {}).get("group_key"))
        route = self.router.resolve(model)
        principal = self.router.admit(model, route, principal)
        if not principal.may_use(model, route.policy):
            raise PermissionDenied(
                f"This key may not use the model `{model}`.", param="model", code="model_not_allowed"
            )
        # The input as one "message", so identical prompts share a context hash (prompt grouping) and an
        # episode id in a header or metadata is checked as on chat.
        hashes = ConversationHashes.of(
            [{"role": "prompt", "content": body.get("prompt", body.get("input"))}], principal.project
        )
        episode = assign_episode(headers.get("x-episode-id"), metadata, hashes, self.chat.stitch)
        user = body.get("user")
        route = self.router.assign(
            route, principal, user if isinstance(user, str) and user else episode.episode_id
        )
        supplied = headers.get("x-request-id")
        return RelayContext(
            call_id=new_id(),
            client_request_id=supplied if supplied and valid_id(supplied) else None,
            body=body,
            route=route,
            model=model,
            episode_id=episode.episode_id,
            context_hash=hashes.context_hash,
            capture=headers.get("x-kaizen-no-log", "").lower() not in ("true", "1", "yes"),
            started=started,
            principal=principal,
        )

    def prepare_completion(
        self, raw_body: bytes, headers: Mapping[str, str], principal: Principal
    ) -> RelayContext:
        started = time.perf_counter()
        body, request = self._parse(raw_body, CompletionRequest)
        if not uniform_items(request.prompt):
            raise InvalidRequest(
                "prompt must be a string, or a list of strings, of token ids or of token-id lists",
                param="prompt",
            )
        if request.stream_options is not None and not request.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
        if request.n is not None and request.n > self.chat.max_n:
            raise InvalidRequest(
                f"n={request.n} is above this gateway's limit of {self.chat.max_n}", param="n"
            )
        if not self.engine.capabilities.prompt_logprobs:
            refuse_prompt_logprobs(body, echo_needs_logprobs=True)
        ctx = self._context(body, request.model, headers, principal, request.metadata, started)
        ctx.stream = bool(request.stream)
        ctx.echo = bool(request.echo)
        ctx.keep_logprobs = request.logprobs is not None
        ctx.keep_usage = bool(request.stream_options and request.stream_options.include_usage)
        self._refuse_unrecordable(ctx)
        return ctx

    def prepare_embeddings(
        self, raw_body: bytes, headers: Mapping[str, str], principal: Principal
    ) -> RelayContext:
        started = time.perf_counter()
        body, request = self._parse(raw_body, EmbeddingRequest)
        if not uniform_items(request.input):
            raise InvalidRequest(
                "input must be a string, or a list of strings, of token ids or of token-id lists",
                param="input",
            )
        ctx = self._context(body, request.model, headers, principal, None, started)
        ctx.capture = ctx.capture and self.capture_embeddings
        self._refuse_unrecordable(ctx)
        return ctx

    def _refuse_unrecordable(self, ctx: RelayContext) -> None:
        """Strict capture, and the capture log cannot be written: a call to be captured is refused before the
        engine."""
        if ctx.capture and self.sink.refusing:
            raise CaptureUnavailable()

    # ------------------------------------------------------------------ engine calls
    def _engine_body(self, ctx: RelayContext, *, sampled: bool) -> dict[str, Any]:
        body = {k: v for k, v in ctx.body.items() if k != "metadata"}
        body["model"] = ctx.route.engine_model
        caps = self.engine.capabilities
        # An echo call is captured without token ids and behaviour logprobs: with `logprobs` an engine computes the
        # prompt's too, and vLLM leaves the prompt out of the text when asked for token ids.
        if sampled and not ctx.echo:
            if caps.logprobs and not ctx.keep_logprobs:
                body["logprobs"] = 0  # the sampled token's logprob only: the behaviour policy's
            if caps.token_ids:
                body["return_token_ids"] = True
        if sampled and ctx.stream:
            body["stream_options"] = {**(ctx.body.get("stream_options") or {}), "include_usage": True}
        return body

    async def _acquire(self, ctx: RelayContext, request: dict[str, Any]) -> None:
        try:
            await self.router.acquire(ctx.route)
        except APIError as exc:
            self._record(ctx, request, None, status="error", error=exc, ttft=None)
            raise

    async def complete(self, ctx: RelayContext) -> bytes:
        await self._acquire(ctx, _completion_request(ctx.body))
        try:
            raw = await self.engine.relay("/completions", self._engine_body(ctx, sampled=True))
            completion, captured = normalize_text_completion(
                raw, response_id=f"cmpl-{ctx.call_id}", model=ctx.model, keep_logprobs=ctx.keep_logprobs
            )
        except APIError as exc:
            self._record(ctx, _completion_request(ctx.body), None, status="error", error=exc, ttft=None)
            raise
        except asyncio.CancelledError:
            self._record(
                ctx, _completion_request(ctx.body), None, status="client_disconnected", error=None, ttft=None
            )
            raise
        finally:
            self.router.release(ctx.route)
        self._record(ctx, _completion_request(ctx.body), captured, status="ok", error=None, ttft=None)
        return _encode(completion)

    async def stream(self, ctx: RelayContext) -> AsyncIterator[bytes]:
        request = _completion_request(ctx.body)
        await self._acquire(ctx, request)
        try:
            engine_stream = await self.engine.open_relay_stream(
                "/completions", self._engine_body(ctx, sampled=True)
            )
        except APIError as exc:
            self.router.release(ctx.route)
            self._record(ctx, request, None, status="error", error=exc, ttft=None)
            raise
        assembler = TextStreamAssembler(
            response_id=f"cmpl-{ctx.call_id}",
            model=ctx.model,
            keep_logprobs=ctx.keep_logprobs,
            keep_usage=ctx.keep_usage,
        )

        def finish(status: str, error: APIError | None, ttft: float | None) -> None:
            self.router.release(ctx.route)
            self._record(ctx, request, assembler.captured(), status=status, error=error, ttft=ttft)

        return relay_events(engine_stream, assembler, ctx.started, finish)

    async def embed(self, ctx: RelayContext) -> bytes:
        request = {"input": ctx.body.get("input"), "params": _params(ctx.body, "input")}
        await self._acquire(ctx, request)
        try:
            raw = await self.engine.relay("/embeddings", self._engine_body(ctx, sampled=False))
            embeddings = normalize_embeddings(raw, model=ctx.model)
        except APIError as exc:
            self._record(ctx, request, None, status="error", error=exc, ttft=None)
            raise
        finally:
            self.router.release(ctx.route)
        usage = {
            "prompt_tokens": embeddings.usage.prompt_tokens,
            "total_tokens": embeddings.usage.total_tokens,
        }
        summary = {"data": [{"index": e.index, "dimensions": len(e.embedding)} for e in embeddings.data]}
        self._record(
            ctx, request, Captured(response=summary, usage=usage), status="ok", error=None, ttft=None
        )
        return _encode(embeddings)

    # ------------------------------------------------------------------ capture
    def _record(
        self,
        ctx: RelayContext,
        request: dict[str, Any],
        captured: Captured | None,
        *,
        status: str,
        error: APIError | None,
        ttft: float | None,
    ) -> None:
        if ctx.charge_tokens is not None and captured is not None and captured.usage:
            usage = captured.usage
            ctx.charge_tokens(int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0))
        if not ctx.capture:
            self.sink.opt_out()
            return
        metadata = ctx.body.get("metadata") if isinstance(ctx.body.get("metadata"), dict) else {}
        user = ctx.body.get("user")
        record = CallRecord(
            id=ctx.call_id,
            client_request_id=ctx.client_request_id,
            episode_id=ctx.episode_id,
            episode_resolved=True,
            policy=ctx.route.policy,
            model=ctx.model,
            adapter_version=ctx.route.adapter_version,
            engine_model=ctx.route.engine_model,
            stream=ctx.stream,
            request=request,
            response=captured.response if captured else None,
            prompt_token_ids=captured.prompt_token_ids if captured else None,
            completion_token_ids=captured.completion_token_ids if captured else None,
            completion_logprobs=captured.completion_logprobs if captured else None,
            usage=captured.usage if captured else None,
            latency_ms=(time.perf_counter() - ctx.started) * 1000,
            ttft_ms=ttft * 1000 if ttft is not None else None,
            status=status,
            error={"status": error.status_code, "message": error.message, "code": error.code}
            if error
            else None,
            context_hash=ctx.context_hash,
            group_key=metadata.get("group_key") if metadata else None,
            user=stored_user(user),
            episode_metadata=dict(metadata or {}),
            key_id=ctx.principal.key_id,
            project=ctx.principal.project,
            created_at=time.time(),
        )
        redactor = self.router.redactor(ctx.route.policy)
        if redactor is not None:
            record = redact_call(record, redactor)
        if not self.sink.submit(record):  # strict capture, and the capture log cannot take it
            raise CaptureUnavailable()


def _params(body: dict[str, Any], *stored: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in stored}


def _completion_request(body: dict[str, Any]) -> dict[str, Any]:
    """How a text completion's request is stored: the prompt as sent, and the other parameters."""
    return {"prompt": body.get("prompt"), "params": _params(body, "prompt")}
