"""`POST /v1/chat/completions`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, Protocol, cast

from litestar import Controller, Request, post
from litestar.di import NamedDependency
from litestar.response import Stream
from litestar.types import ASGIApp, Receive, Scope, Send

from gateway.auth import authenticates, principal_of
from gateway.chat import ChatService
from gateway.errors import APIError
from gateway.rate_limits import SPENDS_TOKENS, token_meter
from gateway.routing import Route


class ChatController(Controller):
    path = "/chat/completions"
    before_request = staticmethod(authenticates("chat"))

    # The media type is the stream's: Litestar gives a `Stream` its handler's, and a `JSONReply` sets its own.
    @post("", status_code=200, media_type="text/event-stream", opt={SPENDS_TOKENS: True})
    async def create(self, request: Request[Any, Any, Any], chat: NamedDependency[ChatService]) -> ASGIApp:
        ctx = chat.prepare(await request.body(), request.headers, principal_of(request))
        ctx.charge_tokens = token_meter(request.scope)
        try:
            if ctx.request.stream:
                relay = await chat.stream(ctx)
                # A Response (a Stream) is sent the usual way whatever the handler's annotation says.
                stream = Stream(relay, headers={**call_headers(ctx), "cache-control": "no-cache"})
                return cast(ASGIApp, stream)
            reply = await unless_disconnected(chat.complete(ctx), request.receive)
            return JSONReply(reply, call_headers(ctx))
        except APIError as exc:  # the call was recorded: its error answer carries its ids too
            exc.headers.update(call_headers(ctx))
            raise


class JSONReply:
    """A 200 with a JSON body, sent as is. The handler returns it instead of a Litestar `Response`, which would be
    converted to another object, its headers merged and encoded again, on every call; annotated `ASGIApp`,
    Litestar passes it through untouched (a `Stream` still goes the usual way)."""

    __slots__ = ("body", "headers")

    def __init__(self, body: bytes, headers: dict[str, str]) -> None:
        self.body = body
        self.headers = headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(self.body))]
        raw.extend((name.encode("latin-1"), value.encode("latin-1")) for name, value in self.headers.items())
        await send({"type": "http.response.start", "status": 200, "headers": raw})
        await send({"type": "http.response.body", "body": self.body, "more_body": False})


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
    otherwise run to the end and be recorded as a served reply nobody received.

    `work` runs in the caller's task, which a disconnect cancels: one task per call fewer than running it in a
    task of its own and waiting for the first of the two (13 µs a call on the reference machine)."""
    handler = asyncio.current_task()
    assert handler is not None
    left = finished = False

    def on_disconnect(watcher: asyncio.Future[None]) -> None:
        nonlocal left
        if not finished and not watcher.cancelled():
            left = True
            handler.cancel()

    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    watcher.add_done_callback(on_disconnect)
    try:
        return await work
    except asyncio.CancelledError:
        if not left:
            raise
        handler.uncancel()
        raise ClientDisconnected(
            "the client disconnected before the reply", code="client_disconnected"
        ) from None
    finally:
        finished = True
        watcher.cancel()
