"""uvicorn's HTTP protocol with OpenAI-shaped answers to requests its parser rejects.

A request the HTTP parser cannot read (e.g. a bare `\\n` inside a header value) never reaches the app: uvicorn
answers it itself with a plain-text 400. Clients of an OpenAI-compatible API parse error bodies as JSON, so
this subclass sends the same 400 in OpenAI's error shape.
"""

from __future__ import annotations

import msgspec
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.protocol import ErrorBody, ErrorResponse

_BODY = msgspec.json.encode(
    ErrorResponse(
        ErrorBody("The HTTP request could not be parsed.", "invalid_request_error", None, "bad_http")
    )
)


class OpenAIHttpToolsProtocol(HttpToolsProtocol):
    """Pass as uvicorn's `http=`: identical to httptools' protocol except for the parser-error answer."""

    def send_400_response(self, msg: str) -> None:
        head = [b"HTTP/1.1 400 Bad Request\r\n"]
        for name, value in self.server_state.default_headers:
            head.append(name + b": " + value + b"\r\n")
        head.append(b"content-type: application/json\r\n")
        head.append(b"content-length: " + str(len(_BODY)).encode("ascii") + b"\r\n")
        head.append(b"connection: close\r\n\r\n")
        self.transport.write(b"".join(head) + _BODY)
        self.transport.close()
