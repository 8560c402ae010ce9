"""Errors the gateway answers with, always in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
from litestar import Response
from litestar.types import Send

from gateway.bare_asgi import send_json
from gateway.protocol import ErrorBody, ErrorResponse

if TYPE_CHECKING:
    from trainer.control.policy_config import InvalidPolicyConfig

_encode = msgspec.json.Encoder().encode


class APIError(Exception):
    """An error with an HTTP status and an OpenAI-shaped body. Raise it anywhere; the app renders it."""

    status_code = 400
    error_type = "invalid_request_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status_code: int | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.headers: dict[str, str] = {}
        if status_code is not None:
            self.status_code = status_code

    def body(self) -> ErrorResponse:
        return ErrorResponse(ErrorBody(self.message, self.error_type, self.param, self.code))

    def response_headers(self) -> dict[str, str]:
        """The answer's own headers: what was added to `headers`, and `retry-after` when it has one."""
        headers = dict(self.headers)
        if self.retry_after is not None:
            headers["retry-after"] = str(max(1, round(self.retry_after)))
        return headers

    def to_response(self) -> Response[ErrorResponse]:
        return Response(self.body(), status_code=self.status_code, headers=self.response_headers())

    async def send(self, send: Send) -> None:
        """Answer with this error over bare ASGI, as `to_response` does through Litestar (the chat route's)."""
        own = (
            (name.encode("latin-1"), value.encode("latin-1"))
            for name, value in self.response_headers().items()
        )
        await send_json(send, self.status_code, _encode(self.body()), leading=own)


class InvalidRequest(APIError):
    status_code = 400


class InternalError(APIError):
    """A defect in the gateway: logged with its traceback where it is caught; the client gets no detail."""

    status_code = 500
    error_type = "api_error"

    def __init__(self) -> None:
        super().__init__("Internal error in the gateway.", code="internal_error")


def undecodable_body(exc: RecursionError | UnicodeDecodeError) -> InvalidRequest:
    """The 400 of a body the JSON decoders give up on: nested deeper than the interpreter's stack, or not UTF-8."""
    if isinstance(exc, RecursionError):
        return InvalidRequest("The JSON body is nested too deeply.", code="invalid_json")
    return InvalidRequest("The request body is not valid UTF-8.", code="invalid_json")


def policy_not_found(name: str) -> NotFound:
    """The 404 of every admin route that names a policy that does not exist."""
    return NotFound(f"no policy named {name!r}", param="name", code="policy_not_found")


def invalid_policy_config(exc: InvalidPolicyConfig, param: str = "config") -> InvalidRequest:
    """A 400 whose message names every problem of a submitted policy configuration (`train.epochs: ...`)."""
    return InvalidRequest(str(exc), param=param, code="invalid_policy_config")


class AuthenticationError(APIError):
    status_code = 401
    error_type = "authentication_error"


class PermissionDenied(APIError):
    """The key is valid but may not do this (a scope it lacks, a model it may not use)."""

    status_code = 403
    error_type = "permission_error"


class NotFound(APIError):
    status_code = 404
    error_type = "not_found_error"


class Conflict(APIError):
    """The request contradicts what is stored (a unique key taken, e.g. by a concurrent request)."""

    status_code = 409


class PayloadTooLarge(APIError):
    status_code = 413


class ServiceUnavailable(APIError):
    """What the request needs is not there for now (the database, or the keys and policies read from it): a
    503 with `Retry-After`, never a 500."""

    status_code = 503
    error_type = "api_error"


class CaptureUnavailable(ServiceUnavailable):
    """With `capture_require_durable`: the call cannot be recorded durably (its capture log cannot be written),
    so it is refused rather than answered unrecorded."""

    def __init__(self) -> None:
        super().__init__(
            "this gateway cannot record calls durably right now (its capture log cannot be written) and is set to "
            "refuse calls it cannot record; retry later or on another replica",
            code="capture_unavailable",
            retry_after=1.0,
        )


class EngineError(APIError):
    """The engine failed; the client gets a 5xx with the OpenAI shape, never a traceback."""

    status_code = 502
    error_type = "api_error"


class EngineBadResponse(EngineError):
    def __init__(self, message: str) -> None:
        super().__init__(f"bad response from the engine: {message}", code="bad_engine_response")


class EngineDisconnected(EngineError):
    """The engine's connection broke, or its stream ended early: the engine died or dropped the call. Nothing
    of the answer is usable, so a call not yet relayed may go to another engine replica."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="engine_error")


class EngineTimeout(EngineError):
    status_code = 504

    def __init__(self, message: str = "the engine did not answer in time") -> None:
        super().__init__(message, code="engine_timeout")


class EngineUnavailable(EngineError):
    status_code = 503

    def __init__(self, message: str = "the engine is not available", retry_after: float = 5.0) -> None:
        super().__init__(message, code="engine_unavailable", retry_after=retry_after)
