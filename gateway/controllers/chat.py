"""`POST /v1/chat/completions`."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, Response, post
from litestar.di import NamedDependency
from litestar.response import Stream

from gateway.chat import ChatService
from gateway.errors import APIError


class ChatController(Controller):
    path = "/chat/completions"

    @post("", status_code=200)
    async def create(
        self, request: Request[Any, Any, Any], chat: NamedDependency[ChatService]
    ) -> Response[bytes] | Stream:
        ctx = chat.prepare(await request.body(), request.headers)
        # x-request-id: the server's id of this call (unique; what feedback names), as OpenAI's API answers; a
        # client's own x-request-id is stored beside it and echoed as x-client-request-id.
        # x-kaizen-model: what actually served the call (`policy@N` for a policy), so clients can tell versions apart.
        headers = {
            "x-request-id": ctx.call_id,
            "x-episode-id": ctx.episode_id,
            "x-kaizen-model": ctx.route.engine_model,
        }
        if ctx.client_request_id is not None:
            headers["x-client-request-id"] = ctx.client_request_id
        try:
            if ctx.request.stream:
                relay = await chat.stream(ctx)
                return Stream(
                    relay, media_type="text/event-stream", headers={**headers, "cache-control": "no-cache"}
                )
            return Response(await chat.complete(ctx), media_type="application/json", headers=headers)
        except APIError as exc:  # the call was recorded: its error answer carries its ids too
            exc.headers.update(headers)
            raise
