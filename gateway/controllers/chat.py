"""`POST /v1/chat/completions`: the hot path, served by a bare ASGI app ahead of Litestar.

`ChatRoute` reads the key, the headers and the body from the ASGI messages itself and answers errors in the same
shape as the app's exception handlers: Litestar's request, dependency and response machinery took about a quarter
of the serving thread's time per call (docs/performance.md, "Where the time goes"). The app's own middleware
(metrics, host and media-type checks, rate limits) wraps it as it wraps Litestar's routes. Only a browser's call
to a gateway with CORS origins (an `Origin` header) goes through Litestar, whose CORS handling answers it, to
`ChatController`; both run the call with `answer`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable
from typing import Any, Protocol, TypeVar

from litestar import Controller, Request, post
from litestar.di import NamedDependency
from litestar.enums import ScopeType
from litestar.types import ASGIApp, Receive, Scope, Send

from gateway.auth import KeyRing, authenticate_client, authenticates, principal_of
from gateway.bare_asgi import send_json
from gateway.chat import CallContext, ChatService, LastEvent
from gateway.errors import APIError, InternalError, PayloadTooLarge, undecodable_body
from gateway.rate_limits import SPENDS_TOKENS, token_meter
from gateway.routing import Route

log = logging.getLogger(__name__)
T = TypeVar("T")

PATH = "/v1/chat/completions"


class ChatController(Controller):
    """The chat route of browsers' calls when CORS is on (`ChatRoute` serves all others)."""

    path = "/chat/completions"
    before_request = staticmethod(authenticates("chat"))

    @post("", status_code=200, opt={SPENDS_TOKENS: True})
    async def create(self, request: Request[Any, Any, Any], chat: NamedDependency[ChatService]) -> ASGIApp:
        ctx = chat.prepare(await request.body(), request.headers, principal_of(request))
        ctx.charge_tokens = token_meter(request.scope)
        # Annotated `ASGIApp`, the reply is sent as it is: no Litestar `Response` is made of it.
        return await answer(chat, ctx, request.receive)


class ChatRoute:
    """`POST /v1/chat/completions` as a bare ASGI app: what `ChatController` does, without Litestar's request
    machinery; every error gets the answer the app's exception handlers give it."""

    def __init__(self, chat: ChatService, keys: KeyRing, max_body_bytes: int) -> None:
        self.chat = chat
        self.keys = keys
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            reply = await self._run(scope, receive)
        except APIError as exc:
            await exc.send(send)
            return
        except (RecursionError, UnicodeDecodeError) as exc:
            log.info("undecodable body on POST %s: %s", PATH, type(exc).__name__)
            await undecodable_body(exc).send(send)
            return
        except Exception:
            log.exception("unhandled error on POST %s", PATH)
            await InternalError().send(send)
            return
        await reply(scope, receive, send)

    async def _run(self, scope: Scope, receive: Receive) -> ASGIApp:
        # Names are lower-case in ASGI; where one repeats, the first counts, as in Litestar's `Headers.get`.
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.decode("latin-1"), value.decode("latin-1"))
        principal = authenticate_client(self.keys, headers.get("authorization"), "chat")
        body = await read_body(receive, headers.get("content-length"), self.max_body_bytes)
        ctx = self.chat.prepare(body, headers, principal)
        ctx.charge_tokens = token_meter(scope)
        return await answer(self.chat, ctx, receive)


def chat_route_first(route: ASGIApp, app: ASGIApp, *, cors: bool) -> ASGIApp:
    """The app's ASGI handler with `route` taking `POST /v1/chat/completions` (but a browser's call, when `cors`:
    Litestar's CORS handling answers that). `path_template` names the route for the metrics, as Litestar's does."""

    async def dispatch(scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == ScopeType.HTTP
            and scope["path"] == PATH
            and scope["method"] == "POST"
            and not (cors and any(name == b"origin" for name, _ in scope["headers"]))
        ):
            scope["path_template"] = PATH
            await route(scope, receive, send)
        else:
            await app(scope, receive, send)

    return dispatch


async def read_body(receive: Receive, declared: str | None, limit: int) -> bytes:
    """The request body, refused with a 413 once it is past `limit` bytes (or declared so), as Litestar does."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large()
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientDisconnected(
                "the client disconnected before its body arrived", code="client_disconnected"
            )
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large()
        if not message.get("more_body", False):
            return chunk if not chunks else b"".join([*chunks, chunk])
        chunks.append(chunk)


def _too_large() -> PayloadTooLarge:
    return PayloadTooLarge("Request body too large.", code="body_too_large")


async def answer(chat: ChatService, ctx: CallContext, receive: Receive) -> ASGIApp:
    """Run a prepared call: what sends its reply, the JSON body or the event stream. An error answer carries the
    call's ids too, as the call was recorded."""
    try:
        if ctx.request.stream:
            events = await chat.stream(ctx)
            return EventStream(events, {**call_headers(ctx), "cache-control": "no-cache"})
        reply = await unless_disconnected(chat.complete(ctx), receive)
        return JSONReply(reply, call_headers(ctx))
    except APIError as exc:
        exc.headers.update(call_headers(ctx))
        raise


class JSONReply:
    """A 200 with a JSON body, sent as is. A handler returns it instead of a Litestar `Response`, which would be
    converted to another object, its headers merged and encoded again, on every call; annotated `ASGIApp`,
    Litestar passes it through untouched."""

    __slots__ = ("body", "headers")

    def __init__(self, body: bytes, headers: dict[str, str]) -> None:
        self.body = body
        self.headers = headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = ((name.encode("latin-1"), value.encode("latin-1")) for name, value in self.headers.items())
        await send_json(send, 200, self.body, headers)


class EventStream:
    """A 200 of server-sent events relayed as they come. A client that disconnects stops the relay: the events
    are closed, so the call is recorded with what was sent (`gateway.chat.event_chunks`)."""

    __slots__ = ("events", "headers")

    def __init__(self, events: AsyncGenerator[bytes, None], headers: dict[str, str]) -> None:
        self.events = events
        self.headers = headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in self.headers.items()]
        raw.append((b"content-type", b"text/event-stream; charset=utf-8"))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": raw})
            await unless_disconnected(self._relay(send), receive)
        except ClientDisconnected:
            pass
        finally:
            await self.events.aclose()

    async def _relay(self, send: Send) -> None:
        async for event in self.events:
            last = type(event) is LastEvent
            await send({"type": "http.response.body", "body": event, "more_body": not last})
            if last:
                return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


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


async def unless_disconnected(work: Awaitable[T], receive: Receive) -> T:
    """Await `work`, cancelling it if the client disconnects first (the body is already read, so the next
    ASGI message can only be the disconnect): a non-streamed call would otherwise run to the end and be recorded
    as a served reply nobody received, and a stream would be relayed to nobody.

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
