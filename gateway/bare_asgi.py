"""Answers sent over bare ASGI, where no Litestar `Response` is made: the chat route's replies and errors, and
the middleware that refuses a request before any handler runs (media type, host, rate limit).

These run on every chat call and every refusal, so the answer is sent as the caller built it: the body already
encoded, the headers already bytes, nothing copied or encoded again here.
"""

from __future__ import annotations

from collections.abc import Iterable

from litestar.types import Send

Header = tuple[bytes, bytes]

_CONTENT_TYPE: Header = (b"content-type", b"application/json")


async def send_json(
    send: Send, status: int, body: bytes, headers: Iterable[Header] = (), *, leading: Iterable[Header] = ()
) -> None:
    """Send a whole answer whose body is encoded JSON: `leading` headers, then its content type and length,
    then `headers` (an error's own headers have always come first, a reply's after)."""
    raw = [*leading, _CONTENT_TYPE, (b"content-length", b"%d" % len(body)), *headers]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})
