"""The client for OpenAI-compatible servers, shared by the `upstream` and `vllm` engines.

The hot path (chat, relayed calls, streams) goes through `gateway.engines.http1`, the project's own HTTP/1.1
client on asyncio's protocol API: aiohttp's client was about a third of the serving process's CPU per call
(docs/performance.md). The rare calls (model listing, adapter loading, health pings) still use an aiohttp
session, created on first use.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec

from gateway.engines.base import EngineStream
from gateway.engines.http1 import HTTP1Client, ProtocolError, Response, ResponseBroken
from gateway.errors import (
    APIError,
    EngineBadResponse,
    EngineDisconnected,
    EngineError,
    EngineTimeout,
    EngineUnavailable,
    InvalidRequest,
)

log = logging.getLogger(__name__)

_decode = msgspec.json.decode
_encode = msgspec.json.encode


def _error_fields(body: bytes) -> tuple[str, str | None, str | None]:
    """(message, param, code) of an engine's error body; `param` and `code` only where they are strings
    (vLLM's code is the integer status)."""
    try:
        payload = _decode(body)
    except msgspec.DecodeError:
        return body[:500].decode("utf-8", "replace") or "no error message", None, None
    if isinstance(payload, dict):
        error = payload.get("error", payload)
        if isinstance(error, dict) and error.get("message"):
            param, code = error.get("param"), error.get("code")
            return (
                str(error["message"]),
                param if isinstance(param, str) else None,
                code if isinstance(code, str) else None,
            )
        if isinstance(payload.get("detail"), str):
            return str(payload["detail"]), None, None
        if isinstance(error, str):
            return error, None, None
    return str(payload)[:500], None, None


def map_status(status: int, body: bytes, retry_after: str | None = None) -> APIError:
    """Map an engine's error status to the error the gateway answers with: 4xx relayed with their status and
    `param` (the SDKs choose their exception by status), 5xx -> 502. A 401 or 403 refuses the gateway's own
    upstream key, not the client's, so it is a 502 too."""
    message, param, code = _error_fields(body)
    if status == 429:
        return APIError(message, status_code=429, code="rate_limit_exceeded", retry_after=_float(retry_after))
    if status == 503:
        return EngineUnavailable(
            f"the engine is unavailable: {message}", retry_after=_float(retry_after) or 5.0
        )
    if status in (401, 403):
        return EngineError(
            f"the engine refused the gateway's credentials ({status}): {message}", code="engine_auth_failed"
        )
    if 400 <= status < 500:
        return InvalidRequest(
            f"the engine rejected the request: {message}",
            param=param,
            code=code or f"engine_{status}",
            status_code=status,
        )
    return EngineError(f"the engine failed ({status}): {message}", code="engine_error")


def _float(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


class _SSEStream(EngineStream):
    """The `data:` events of a streamed answer, decoded as their lines arrive, until `data: [DONE]`."""

    def __init__(self, response: Response) -> None:
        self._response = response
        self._done = False
        self._more = False  # another event of the last read is still to come

    def ready(self) -> bool:
        return self._more

    async def __aiter__(self) -> AsyncIterator[Any]:
        response = self._response
        pending = b""
        try:
            while True:
                data = await response.read_some()
                if not data:
                    break
                lines = (pending + data if pending else data).split(b"\n")
                pending = lines.pop()
                payloads = [line[5:].strip() for line in lines if line.startswith(b"data:")]
                last = len(payloads) - 1
                for index, payload in enumerate(payloads):
                    if payload == b"[DONE]":
                        self._done = True
                        return
                    self._more = index < last
                    yield _chunk(payload)
                self._more = False
            if pending.startswith(b"data:"):
                # The last line, with no newline after it, before the connection ended.
                payload = pending[5:].strip()
                if payload == b"[DONE]":
                    self._done = True
                    return
                yield _chunk(payload)
            # EOF before `[DONE]`: the engine died or dropped the connection; the reply is incomplete.
            raise EngineDisconnected("the engine stream ended before it was complete")
        except TimeoutError as exc:
            raise EngineTimeout() from exc
        except ResponseBroken as exc:
            log.warning("the engine connection broke mid-stream: %s", exc)
            raise EngineDisconnected("the engine connection broke mid-stream") from exc

    async def close(self) -> None:
        self._response.close(finished=self._done)


def _chunk(payload: bytes) -> Any:
    try:
        return _decode(payload)
    except msgspec.DecodeError as exc:
        raise EngineBadResponse("a stream chunk was not valid JSON") from exc


class OpenAIHTTPClient:
    """Chat, streaming and model listing against one OpenAI-compatible base URL (ending in /v1)."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str = "",
        timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        max_connections: int = 1024,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"content-type": "application/json"}
        if api_key:
            self._headers["authorization"] = f"Bearer {api_key}"
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._http = HTTP1Client(
            self.base_url,
            headers={"Content-Type": "application/json"}
            | ({"Authorization": f"Bearer {api_key}"} if api_key else {}),
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            max_connections=max_connections,
        )

    @property
    def session(self) -> aiohttp.ClientSession:
        """The aiohttp session of the rare calls."""
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=60)
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=self._timeout,
                headers=self._headers,
                skip_auto_headers=("User-Agent",),
            )
        return self._session

    async def close(self) -> None:
        await self._http.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _post(self, path: str, body: dict[str, Any]) -> Response:
        """Open a streamed answer; an error status raises the mapped error."""
        try:
            response = await self._http.open(path, _encode(body))
        except TimeoutError as exc:
            raise EngineTimeout() from exc
        except (OSError, ProtocolError) as exc:
            raise self._before_head(exc) from exc
        if response.status >= 400:
            try:
                data = await response.read()
            except (TimeoutError, ResponseBroken) as exc:
                raise self._after_head(exc) from exc
            raise map_status(response.status, data, response.headers.get("retry-after"))
        return response

    def _before_head(self, exc: OSError | ProtocolError) -> EngineError:
        """The gateway's error for a failure before the engine's answer began."""
        if isinstance(exc, OSError):
            # The address stays in the log: clients have no use for the engine's host and port.
            log.warning("cannot reach the engine at %s: %s", self.base_url, exc)
            return EngineUnavailable("the engine is not reachable")
        log.warning("engine request to %s failed: %s", self.base_url, exc)
        return EngineError("the engine request failed", code="engine_error")

    @staticmethod
    def _after_head(exc: TimeoutError | ResponseBroken) -> EngineError:
        """The gateway's error for a failure once the engine's answer began."""
        if isinstance(exc, TimeoutError):
            return EngineTimeout()
        log.warning("the engine connection broke: %s", exc)
        return EngineDisconnected("the engine connection broke")

    async def chat(self, body: dict[str, Any]) -> Any:
        return await self.request("/chat/completions", body)

    async def request(self, path: str, body: dict[str, Any]) -> Any:
        """POST `body` to `path` (under the base URL) and return the decoded JSON answer."""
        try:
            reply = await self._http.fetch(path, _encode(body))
        except (TimeoutError, ResponseBroken) as exc:
            raise self._after_head(exc) from exc
        except (OSError, ProtocolError) as exc:
            raise self._before_head(exc) from exc
        if reply.status >= 400:
            raise map_status(reply.status, reply.body, reply.headers.get("retry-after"))
        try:
            return _decode(reply.body)
        except msgspec.DecodeError as exc:
            raise EngineBadResponse("the body was not valid JSON") from exc

    async def open_stream(self, body: dict[str, Any], path: str = "/chat/completions") -> EngineStream:
        return _SSEStream(await self._post(path, body))

    async def get_json(self, path: str, timeout_s: float = 5.0) -> Any:
        async with self.session.get(
            self.base_url + path, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as response:
            data = await response.read()
            if response.status >= 400:
                raise map_status(response.status, data)
            return _decode(data)

    async def post_json(self, path: str, body: dict[str, Any], timeout_s: float = 120.0) -> bytes:
        async with self.session.post(
            self.base_url + path, data=_encode(body), timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as response:
            data = await response.read()
            if response.status >= 400:
                raise map_status(response.status, data)
            return data

    async def list_models(self) -> list[str]:
        payload = await self.get_json("/models")
        items = payload.get("data", []) if isinstance(payload, dict) else []
        return [str(m["id"]) for m in items if isinstance(m, dict) and "id" in m]

    async def lora_adapters(self) -> dict[str, str]:
        """The LoRA adapters the server has loaded, by name, with the path each was loaded from (vLLM lists
        them among its models: `parent` names the base model, `root` the adapter's path)."""
        payload = await self.get_json("/models")
        items = payload.get("data", []) if isinstance(payload, dict) else []
        return {
            str(m["id"]): str(m["root"])
            for m in items
            if isinstance(m, dict) and m.get("parent") and "id" in m and "root" in m
        }

    async def ping(self, url: str, timeout_s: float = 2.0) -> bool:
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                await response.read()
                return response.status < 500
        except (TimeoutError, aiohttp.ClientError):
            return False
