"""uvicorn's HTTP protocols with OpenAI-shaped answers to requests their parsers reject, and read timeouts.

A request the HTTP parser cannot read (e.g. a bare `\\n` inside a header value) never reaches the app: uvicorn
answers it itself with a plain-text 400. Clients of an OpenAI-compatible API parse error bodies as JSON, so
these subclasses send the same 400 in OpenAI's error shape: one for httptools' parser (what uvicorn uses when
httptools is installed, as `kaizen serve` does), one for h11's (uvicorn's pure-Python fallback).

uvicorn never cuts off a client that is slow to send its request: a connection that sends half a head, or a
body a byte a minute, holds its socket and its slot for good (a few hundred such clients exhaust the file
descriptors). The httptools protocol, the one `kaizen serve` runs, therefore bounds both, as nginx's
`client_header_timeout` and `client_body_timeout` do:

- **the head**: from its first byte to its end, `KAIZEN_REQUEST_HEADER_TIMEOUT_S` in all: a head sent a byte at
  a time does not extend it. A new connection that sends nothing for as long is closed; between the requests of
  a kept-alive connection uvicorn's own keep-alive timeout applies.
- **the body**: the longest pause between two reads of the body, `KAIZEN_REQUEST_BODY_TIMEOUT_S`: a large body
  sent steadily is never cut off, a client that stops sending is. Time the gateway itself is not reading (the
  app has not asked for more yet, or has not sent `100 Continue`) does not count.

A client past either limit gets `408` in OpenAI's shape and the connection is closed; one that sent nothing at
all is closed without an answer, and one whose answer has already started is just closed. The app, if it was
waiting for the body, sees the client disconnect. Where a request stands is read off uvicorn's own state (a head
has begun when it made the request's scope, ended when it made its cycle), so no parser callback is wrapped: a
request whose head and body arrive in one read, the common case, costs a few attribute reads after the parser
ran. One timer (a `loop.call_later` handle, never a task) is armed per connection, for a connection that never
sends anything, and another only when a read leaves a head or a body unfinished.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from gateway.protocol import ErrorBody, ErrorResponse
from gateway.settings import Settings

log = logging.getLogger(__name__)

_BODY = msgspec.json.encode(
    ErrorResponse(
        ErrorBody("The HTTP request could not be parsed.", "invalid_request_error", None, "bad_http")
    )
)
_TIMED_OUT = msgspec.json.encode(
    ErrorResponse(
        ErrorBody(
            "The request was not received in time: the client stopped sending it.",
            "invalid_request_error",
            None,
            "request_timeout",
        )
    )
)


def _send_and_close(
    transport: asyncio.Transport, server_state: ServerState, status_line: bytes, body: bytes
) -> None:
    """The whole answer as raw bytes, then close: the request is past saving either way."""
    head = [status_line]
    for name, value in server_state.default_headers:
        head.append(name + b": " + value + b"\r\n")
    head.append(b"content-type: application/json\r\n")
    head.append(b"content-length: " + str(len(body)).encode("ascii") + b"\r\n")
    head.append(b"connection: close\r\n\r\n")
    transport.write(b"".join(head) + body)
    transport.close()


class OpenAIHttpToolsProtocol(HttpToolsProtocol):
    """Pass as uvicorn's `http=` (built with the settings' timeouts by `http_protocol`): httptools' protocol with
    an OpenAI-shaped parser-error answer and the head and body read timeouts."""

    header_timeout_s: float = Settings.model_fields["request_header_timeout_s"].default
    body_timeout_s: float = Settings.model_fields["request_body_timeout_s"].default

    # Class-level defaults: connection_lost may come before connection_made has set anything.
    _timer: asyncio.TimerHandle | None = None
    _head_scope: object = None  # the scope of the head `_head_since` is for (uvicorn makes one per request)
    _head_since = 0.0  # loop time that head's first byte arrived at
    _body_read_at = 0.0  # loop time of the last read while a body is awaited

    def send_400_response(self, msg: str) -> None:
        _send_and_close(self.transport, self.server_state, b"HTTP/1.1 400 Bad Request\r\n", _BODY)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._timer = self.loop.call_later(self.header_timeout_s, self._overdue)  # for an idle connection

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        HttpToolsProtocol.data_received(self, data)  # not super(): this runs for every read
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope and not cycle.more_body:
            return  # the request is all in, nothing is awaited: the common case costs these lines only
        self._awaiting()

    def handle_websocket_upgrade(self) -> None:
        """The connection is another protocol's from here on: this one's timer must not answer on it."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super().handle_websocket_upgrade()

    def _head_pending(self) -> bool:
        """Whether a request's head has begun (uvicorn made its scope) and not ended (made its cycle)."""
        return self.scope is not None and (self.cycle is None or self.cycle.scope is not self.scope)

    def _awaiting(self) -> None:
        """A read left a head or a body unfinished: note when, and make sure the timer runs."""
        now = self.loop.time()
        if self._head_pending():
            if self._head_scope is not self.scope:
                self._head_scope, self._head_since = self.scope, now
            delay = self._head_since + self.header_timeout_s - now
        else:
            self._body_read_at = now
            delay = self.body_timeout_s
        if self.transport.is_closing():
            return
        if self._timer is not None:
            if self._timer.when() <= now + delay:
                return  # it fires in time, and looks again
            self._timer.cancel()  # armed for a later deadline (another request's)
        self._timer = self.loop.call_later(delay, self._overdue)

    def _overdue(self) -> None:
        """The timer: cut the client off if it is past a limit, else wait for the time that is left."""
        self._timer = None
        if self.transport.is_closing():
            return
        now = self.loop.time()
        cycle = self.cycle
        if self.scope is None:  # not a byte since the connection was made
            left = 0.0
        elif self._head_pending():
            left = self._head_since + self.header_timeout_s - now
        elif cycle is not None and cycle.more_body:
            if self.flow.read_paused or cycle.waiting_for_100_continue:
                self._body_read_at = now  # the gateway is not reading: the client cannot be late
            left = self._body_read_at + self.body_timeout_s - now
        else:
            return  # nothing is awaited: the request is in
        if left > 0:
            self._timer = self.loop.call_later(left, self._overdue)
            return
        self._cut_off()

    def _cut_off(self) -> None:
        head = self._head_pending()
        log.info(
            "a request %s from %s did not arrive in time; connection closed",
            "head" if head or self.scope is None else "body",
            self.client,
        )
        if self.scope is None:
            self.transport.close()  # an idle connection: there is no request to answer
            return
        if not head:
            cycle = self.cycle
            assert cycle is not None
            cycle.disconnected = True  # the app's receive() answers `http.disconnect`, its sends are dropped
            cycle.message_event.set()
            if cycle.response_started:
                self.transport.close()
                return
        _send_and_close(self.transport, self.server_state, b"HTTP/1.1 408 Request Timeout\r\n", _TIMED_OUT)


def http_protocol(settings: Settings) -> type[OpenAIHttpToolsProtocol]:
    """The protocol class `kaizen serve` hands uvicorn, with the settings' read timeouts."""

    class Configured(OpenAIHttpToolsProtocol):
        header_timeout_s = settings.request_header_timeout_s
        body_timeout_s = settings.request_body_timeout_s

    return Configured


class OpenAIH11Protocol(H11Protocol):
    """The parser-error answer for h11's protocol (uvicorn's fallback; `kaizen serve` always runs httptools,
    whose protocol alone has the read timeouts)."""

    def send_400_response(self, msg: str) -> None:
        _send_and_close(self.transport, self.server_state, b"HTTP/1.1 400 Bad Request\r\n", _BODY)
