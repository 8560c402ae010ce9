"""`POST /v1/chat/completions`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any, Protocol

from litestar import Controller, Request, Response, post
from litestar.di import NamedDependency
from litestar.response import Stream
from litestar.types import Receive

from gateway.auth import authenticates, principal_of
from gateway.chat import ChatService
from gateway.errors import APIError
from gateway.rate_limits import SPENDS_TOKENS, token_meter
from gateway.routing import Route


class ChatController(Controller):
    path = "/chat/completions"
    before_request = staticmethod(authenticates("chat"))

    @post("", status_code=200, opt={SPENDS_TOKENS: True})
    async def create(
        self, request: Request[Any, Any, Any], chat: NamedDependency[ChatService]
    ) -> Response[bytes] | Stream:
        ctx = chat.prepare(await request.body(), request.headers, principal_of(request))
        ctx.charge_tokens = token_meter(request.scope)
        try:
            if ctx.request.stream:
                relay = await chat.stream(ctx)
                return Stream(
                    relay,
                    media_type="text/event-stream",
                    headers={**call_headers(ctx), "cache-control": "no-cache"},
                )
            reply = await unless_disconnected(chat.complete(ctx), request.receive)
            return Response(reply, media_type="application/json", headers=call_headers(ctx))
        except APIError as exc:  # the call was recorded: its error answer carries its ids too
            exc.headers.update(call_headers(ctx))
            raise


class CallIdentity(Protocol):
    """What identifies a served call to its client: a chat, Responses or relayed call's context."""

    call_id: str
    episode_id: str
    client_request_id: str | None

    @property
    def route(self) -> Route: ...


def call_headers(ctx: CallIdentity) -> dict[str, str]:
    """x-request-id: the server's id of this call (unique; what feedback names), as OpenAI's API answers; a
    client's own x-request-id is stored beside it and echoed as x-client-request-id. x-episode-id: read once the
    call ran, since a follow-up's episode may be found in the database meanwhile. x-kaizen-model: what actually
    served the call (`policy@N` for a policy), so clients can tell versions apart. Error answers of a captured
    call carry them too."""
    headers = {
        "x-request-id": ctx.call_id,
        "x-episode-id": ctx.episode_id,
        "x-kaizen-model": ctx.route.engine_model,
    }
    if ctx.client_request_id is not None:
        headers["x-client-request-id"] = ctx.client_request_id
    return headers


class ClientDisconnected(APIError):
    """The client closed the connection before the reply; nobody reads this answer."""

    status_code = 499


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(work: Awaitable[bytes], receive: Receive) -> bytes:
    """Await `work`, cancelling it if the client disconnects first (the body is already read, so the next
    ASGI message can only be the disconnect). Streams get this from Litestar; a non-streamed call would
    otherwise run to the end and be recorded as a served reply nobody received."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientDisconnected("the client disconnected before the reply", code="client_disconnected")
    return task.result()
