"""uvicorn's HTTP protocols with OpenAI-shaped answers to requests their parsers reject.

A request the HTTP parser cannot read (e.g. a bare `\\n` inside a header value) never reaches the app: uvicorn
answers it itself with a plain-text 400. Clients of an OpenAI-compatible API parse error bodies as JSON, so
these subclasses send the same 400 in OpenAI's error shape: one for httptools' parser (what uvicorn uses when
httptools is installed, as `kaizen serve` does), one for h11's (uvicorn's pure-Python fallback).
"""

from __future__ import annotations

import asyncio

import msgspec
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from gateway.protocol import ErrorBody, ErrorResponse

_BODY = msgspec.json.encode(
    ErrorResponse(
        ErrorBody("The HTTP request could not be parsed.", "invalid_request_error", None, "bad_http")
    )
)


def _send_400(transport: asyncio.Transport, server_state: ServerState) -> None:
    """The whole answer as raw bytes, then close: the parser's state is past saving either way."""
    head = [b"HTTP/1.1 400 Bad Request\r\n"]
    for name, value in server_state.default_headers:
        head.append(name + b": " + value + b"\r\n")
    head.append(b"content-type: application/json\r\n")
    head.append(b"content-length: " + str(len(_BODY)).encode("ascii") + b"\r\n")
    head.append(b"connection: close\r\n\r\n")
    transport.write(b"".join(head) + _BODY)
    transport.close()


class OpenAIHttpToolsProtocol(HttpToolsProtocol):
    """Pass as uvicorn's `http=`: identical to httptools' protocol except for the parser-error answer."""

    def send_400_response(self, msg: str) -> None:
        _send_400(self.transport, self.server_state)


class OpenAIH11Protocol(H11Protocol):
    """The same for h11's protocol."""

    def send_400_response(self, msg: str) -> None:
        _send_400(self.transport, self.server_state)
