"""`POST /v1/completions` and `POST /v1/embeddings`, relayed to the engine (scope `chat`, like chat)."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, Response, post
from litestar.di import NamedDependency
from litestar.response import Stream

from gateway.auth import principal_of, requires
from gateway.completions import RelayService
from gateway.controllers.chat import call_headers, unless_disconnected
from gateway.errors import APIError
from gateway.rate_limits import SPENDS_TOKENS, token_meter


class CompletionsController(Controller):
    path = "/completions"
    guards = [requires("chat")]  # noqa: RUF012

    @post("", status_code=200, opt={SPENDS_TOKENS: True})
    async def create(
        self, request: Request[Any, Any, Any], relay: NamedDependency[RelayService]
    ) -> Response[bytes] | Stream:
        ctx = relay.prepare_completion(await request.body(), request.headers, principal_of(request))
        ctx.charge_tokens = token_meter(request.scope)
        headers = call_headers(ctx)
        try:
            if ctx.stream:
                events = await relay.stream(ctx)
                return Stream(
                    events, media_type="text/event-stream", headers={**headers, "cache-control": "no-cache"}
                )
            reply = await unless_disconnected(relay.complete(ctx), request.receive)
            return Response(reply, media_type="application/json", headers=headers)
        except APIError as exc:
            exc.headers.update(headers)
            raise


class EmbeddingsController(Controller):
    path = "/embeddings"
    guards = [requires("chat")]  # noqa: RUF012

    @post("", status_code=200, opt={SPENDS_TOKENS: True})
    async def create(
        self, request: Request[Any, Any, Any], relay: NamedDependency[RelayService]
    ) -> Response[bytes]:
        ctx = relay.prepare_embeddings(await request.body(), request.headers, principal_of(request))
        ctx.charge_tokens = token_meter(request.scope)
        headers = {"x-request-id": ctx.call_id, "x-kaizen-model": ctx.route.engine_model}
        try:
            reply = await unless_disconnected(relay.embed(ctx), request.receive)
        except APIError as exc:
            exc.headers.update(headers)
            raise
        return Response(reply, media_type="application/json", headers=headers)
