"""What the gateway exposes beyond its own host, and to browsers: safe defaults that hold without configuration.

- A gateway bound to a non-loopback address with no API keys lets anyone who reaches the port call the model
  and read captured conversations: `kaizen serve` refuses to start that way unless `KAIZEN_ALLOW_OPEN=true`.
- A web page can make a browser send a cross-origin "simple request" (a form or `fetch` with `text/plain`)
  without a CORS preflight; the browser cannot read the answer, but the request still runs. Every body-carrying
  request must therefore say `application/json` (a type browsers only send after a preflight), or it gets 415
  before any handler runs.
- CORS is off unless `KAIZEN_CORS_ORIGINS` names the origins allowed to read answers.
- A gateway on loopback without client keys is reachable by any page its machine's browser opens through DNS
  rebinding: the page's own name is re-pointed at 127.0.0.1, so its calls are same-origin (no preflight, answers
  readable) and only their `Host` header tells them apart. Such a gateway answers loopback host names only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import get_args

import msgspec
from litestar.config.cors import CORSConfig
from litestar.enums import ScopeType
from litestar.types import ASGIApp, Receive, Scope, Send

from gateway.auth import KeyRing
from gateway.bare_asgi import send_json
from gateway.machine import is_loopback
from gateway.rate_limits import LimitKind
from gateway.settings import Settings

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_HOST_NOT_ALLOWED = msgspec.json.encode(
    {
        "error": {
            "message": "This gateway has no API keys and answers only loopback host names (localhost, 127.0.0.1, "
            "[::1]) and those in KAIZEN_ALLOWED_HOSTS.",
            "type": "permission_error",
            "param": None,
            "code": "host_not_allowed",
        }
    }
)
_UNSUPPORTED = msgspec.json.encode(
    {
        "error": {
            "message": "Requests with a body must be sent with `Content-Type: application/json`.",
            "type": "invalid_request_error",
            "param": None,
            "code": "unsupported_media_type",
        }
    }
)


def open_exposure(settings: Settings) -> str | None:
    """Why serving with these settings would expose the API to the network unauthenticated, or None."""
    if is_loopback(settings.host) or settings.api_keys or settings.allow_open:
        return None
    return (
        f"refusing to serve on {settings.host}: it is reachable from other machines and no API keys are set, "
        "so anyone could call the model and read captured conversations. Set KAIZEN_API_KEYS (or create a "
        "managed key with `kaizen keys create`), bind "
        "KAIZEN_HOST=127.0.0.1, or set KAIZEN_ALLOW_OPEN=true to serve openly on purpose."
    )


def cors_config(settings: Settings) -> CORSConfig | None:
    """CORS for the configured origins only; None (no CORS headers at all) when none are configured."""
    if not settings.cors_origins:
        return None
    # Any request header: the origins are the operator's own apps, and what an SDK sends grows with it
    # (openai-node's `x-stainless-*`, `openai-organization`, tracing headers). The key is a bearer token,
    # never a cookie, so no credentials mode is involved.
    return CORSConfig(
        allow_origins=settings.cors_origins,
        allow_methods=["GET", "POST", "PUT", "DELETE", "OPTIONS"],
        allow_headers=["*"],
        expose_headers=[
            "x-request-id",
            "x-episode-id",
            "x-kaizen-model",
            "retry-after",
            "retry-after-ms",
            *(
                f"x-ratelimit-{what}-{kind}"
                for what in ("limit", "remaining", "reset")
                for kind in get_args(LimitKind)
            ),
        ],
    )


def _json_media_type(value: bytes) -> bool:
    media = value.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


def json_bodies_only(app: ASGIApp) -> ASGIApp:
    """ASGI middleware: a POST/PUT/PATCH whose body is not declared JSON gets an OpenAI-shaped 415, unread.

    A request without a body and without a content type (an admin `POST .../train`) passes: there is nothing
    to parse, and a cross-origin page cannot send the admin key without a preflight."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == ScopeType.HTTP and scope["method"] in _BODY_METHODS:
            content_type: bytes | None = None
            has_body = False
            for name, value in scope["headers"]:
                if name == b"content-type":
                    content_type = value
                elif (name == b"content-length" and value.strip() not in (b"", b"0")) or (
                    name == b"transfer-encoding"
                ):
                    has_body = True
            if (content_type is not None or has_body) and not (
                content_type is not None and _json_media_type(content_type)
            ):
                await send_json(send, 415, _UNSUPPORTED)
                return
        await app(scope, receive, send)

    return middleware


def _host_name(text: str) -> str:
    """The name in a Host header (or an allowed host), without its port or a final dot, lower-case
    (`[::1]:8000` -> `[::1]`, `Localhost.:80` -> `localhost`)."""
    text = text.strip().lower()
    if text.startswith("["):
        return text.split("]", 1)[0] + "]"
    name = text.rsplit(":", 1)[0] if text.count(":") == 1 else text
    return name[:-1] if name.endswith(".") else name


def _loopback_name(name: str, allowed: frozenset[str]) -> bool:
    # `*.localhost` never leaves the machine (browsers resolve it to loopback themselves).
    return name in allowed or name.endswith(".localhost") or is_loopback(name)


def loopback_hosts_only(settings: Settings, keys: KeyRing) -> Callable[[ASGIApp], ASGIApp]:
    """ASGI middleware: while the gateway is open (no client key) on a loopback address, a request naming any
    other host is refused with an OpenAI-shaped 403 before a handler runs. A request without a Host header is
    no browser's and passes; once a key exists, the key is what keeps a rebinding page out."""
    allowed = frozenset(_host_name(host) for host in settings.allowed_hosts)
    guarded = is_loopback(settings.host)

    def wrap(app: ASGIApp) -> ASGIApp:
        async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
            if guarded and scope["type"] == ScopeType.HTTP and keys.open:
                host = next((value for name, value in scope["headers"] if name == b"host"), None)
                if host is not None and not _loopback_name(_host_name(host.decode("latin-1")), allowed):
                    await send_json(send, 403, _HOST_NOT_ALLOWED)
                    return
            await app(scope, receive, send)

        return middleware

    return wrap
