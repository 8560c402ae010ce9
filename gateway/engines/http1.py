"""A lean HTTP/1.1 client for the gateway's calls to its engine, on asyncio's protocol API.

Why it exists: profiled, aiohttp's client was about 31 % of the serving process's CPU per chat call (its request
object, header handling, timer and write task, response parsing; docs/performance.md, "Where the time goes").
The engine call needs far less: POST a JSON body to one base URL, read a JSON body or an SSE stream back, keep
connections alive. Here a request is one socket write, the answer is parsed by httptools (llhttp, as uvicorn
uses) straight from `data_received`, and a non-streamed call wakes its caller once, when the answer is whole.

Errors keep the distinction the gateway's error mapping needs: before the answer's head arrives a failure is an
`OSError` (cannot connect, connection refused, reset or closed) or a `ProtocolError` (not HTTP); once the head
is in, any broken connection or malformed body is `ResponseBroken`. Timeouts are `TimeoutError` throughout.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Mapping
from typing import cast
from urllib.parse import urlsplit

import httptools

#: Bytes of a streamed body buffered before reading from the socket pauses (the consumer is slower).
_HIGH_WATER = 256 * 1024
#: After a stream's consumer saw all it needed (`[DONE]`), how long the end of the message may take to arrive
#: before the connection is dropped rather than reused.
_LINGER_S = 1.0


class ProtocolError(Exception):
    """The server's answer was not HTTP/1.1 we can parse."""


class ConnectionBroken(ConnectionError):
    """The server closed or reset the connection before its answer's head arrived."""


class ResponseBroken(Exception):
    """The connection broke, or the body was malformed, after the answer's head arrived."""


class _ExtraMessage(Exception):
    """A message the client did not ask for (raised inside the parser to stop it)."""


class Reply:
    """A whole answer: status, headers (names lower-cased) and body."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body


class _Connection(asyncio.Protocol):
    """One keep-alive connection and the state of the exchange on it (one at a time)."""

    def __init__(self, client: HTTP1Client) -> None:
        self._client = client
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.generation = client.generation
        self.counted = True  # holds one of the client's connection slots
        self.idle = False
        self.idle_since = 0.0
        self.reused = False
        self.lost = False
        self.busy = False
        self.lingering = False
        self.streaming = False
        self.paused = False
        self.deadline: asyncio.TimerHandle | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body: list[bytes] = []
        self.buffered = 0
        self.head_done = False
        self.until_close = False
        self.complete = False
        self.keep_alive = True
        self.got_bytes = False
        self.error: BaseException | None = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if not self.busy:
            # Nothing was asked: a server that talks out of turn does not get its connection reused.
            self.keep_alive = False
            self.abort()
            return
        self.got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.keep_alive = False
            if not self.complete:
                self._fail(ProtocolError(f"unparseable answer: {exc}"))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.keep_alive = False
        if self.idle:
            self._client._discard(self)  # the server closed an idle connection
            return
        if self.busy and not self.complete:
            if exc is None and self.until_close:
                self.on_message_complete()  # a body framed by the connection's end
            else:
                reason = f": {exc}" if exc is not None else ""
                self._fail(ConnectionBroken(f"the server closed the connection{reason}"))
        if self.lingering:
            self._client._discard(self)
        self._wake()

    # httptools callbacks

    def on_message_begin(self) -> None:
        if self.complete or self.head_done:
            raise _ExtraMessage

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        parser = self._parser
        self.status = parser.get_status_code()
        self.keep_alive = parser.should_keep_alive()
        headers = self.headers
        self.until_close = (
            "content-length" not in headers
            and "transfer-encoding" not in headers
            and self.status not in (204, 304)
        )
        self.head_done = True
        if self.streaming:
            self._wake()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        if self.streaming:
            self.buffered += len(body)
            if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
                self.paused = True
                self.transport.pause_reading()
            self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        if self.lingering:
            self._client._release(self)
        else:
            self._wake()

    # the exchange

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def expire(self) -> None:
        """The exchange's time is up: the connection is dropped, whatever state it is in."""
        self.deadline = None
        self.keep_alive = False
        if self.lingering:
            self.abort()
            self._client._discard(self)
            return
        if not self.complete:
            self._fail(TimeoutError())
        self.abort()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def start(self, data: bytes, deadline: float, streaming: bool) -> None:
        self._reset()
        self.busy = True
        self.idle = False
        self.streaming = streaming
        assert self.transport is not None
        self.deadline = self._loop.call_at(deadline, self.expire)
        self.transport.write(data)

    def end(self) -> None:
        """The exchange is over (the connection goes back to the pool or away)."""
        self.busy = False
        self.lingering = False
        self._waiter = None
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        if self.paused and self.transport is not None and not self.lost:
            self.paused = False
            self.transport.resume_reading()

    def _raise(self) -> None:
        error = self.error
        assert error is not None
        if self.head_done and not isinstance(error, TimeoutError):
            raise ResponseBroken(str(error) or type(error).__name__) from error
        raise error

    async def _wait(self) -> None:
        self._waiter = waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    async def read_to_end(self) -> None:
        while not self.complete:
            if self.error is not None:
                self._raise()
            await self._wait()

    async def read_head(self) -> None:
        while not self.head_done:
            if self.error is not None:
                self._raise()
            await self._wait()

    async def read_all(self) -> bytes:
        await self.read_to_end()
        body = self.body
        return body[0] if len(body) == 1 else b"".join(body)

    async def read_some(self) -> bytes:
        """What arrived of the body since the last call; b"" at its end."""
        while not self.body:
            if self.complete:
                return b""
            if self.error is not None:
                self._raise()
            await self._wait()
        body = self.body
        data = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        self.buffered = 0
        if self.paused and self.transport is not None and not self.lost:
            self.paused = False
            self.transport.resume_reading()
        return data


class Response:
    """A streamed answer whose head has arrived. Read it with `read_some` (or `read`); `close` when done."""

    __slots__ = ("_client", "_conn", "headers", "status")

    def __init__(self, client: HTTP1Client, conn: _Connection) -> None:
        self._client = client
        self._conn: _Connection | None = conn
        self.status = conn.status
        self.headers = conn.headers

    async def read_some(self) -> bytes:
        """The body's next bytes, as they arrive; b"" at its end, when the connection goes back to the pool."""
        conn = self._conn
        if conn is None:
            return b""
        try:
            data = await conn.read_some()
        except BaseException:
            self.close()
            raise
        if not data:
            self.close()
        return data

    async def read(self) -> bytes:
        """The rest of the body."""
        conn = self._conn
        if conn is None:
            return b""
        try:
            return await conn.read_all()
        finally:
            self.close()

    def close(self, finished: bool = False) -> None:
        """Give the connection back: reused if the message was read to its end, dropped otherwise. `finished`
        says the reader has all it needs though the message has not ended yet: the connection is then reused
        if its end arrives within a second."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if conn.complete:
            self._client._release(conn)
        elif finished and conn.error is None and not conn.lost:
            conn.end()
            conn.body.clear()
            conn.busy = conn.lingering = True
            conn.streaming = False
            conn.deadline = asyncio.get_running_loop().call_later(_LINGER_S, conn.expire)
        else:
            self._client._discard(conn)


class HTTP1Client:
    """POSTs to one base URL (`http` or `https`, with an optional path prefix) over a pool of keep-alive
    connections: at most `max_connections`, idle ones reused newest first and closed after `idle_timeout_s`."""

    def __init__(
        self,
        base_url: str,
        *,
        headers: Mapping[str, str] | None = None,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        max_connections: int = 1024,
        idle_timeout_s: float = 60.0,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self._tls = parts.scheme == "https"
        self._ssl: ssl.SSLContext | None = None
        self._prefix = parts.path.rstrip("/")
        host = f"[{self.host}]" if ":" in self.host else self.host
        if parts.port is not None:
            host = f"{host}:{parts.port}"
        lines = [f"Host: {host}"] + [f"{name}: {value}" for name, value in (headers or {}).items()]
        self._header_lines = "\r\n".join(lines)
        self._heads: dict[str, bytes] = {}
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self.generation = 0
        self.opened = 0  # connections made, for tests and diagnostics
        self._count = 0  # connections open or being opened
        self._idle: list[_Connection] = []
        self._slot_waiters: deque[asyncio.Future[None]] = deque()
        self._sweeper: asyncio.TimerHandle | None = None

    def _request(self, path: str, body: bytes) -> bytes:
        head = self._heads.get(path)
        if head is None:
            head = self._heads[path] = (
                f"POST {self._prefix}{path} HTTP/1.1\r\n{self._header_lines}\r\nContent-Length: "
            ).encode("latin-1")
        return b"%b%d\r\n\r\n%b" % (head, len(body), body)

    async def fetch(self, path: str, body: bytes) -> Reply:
        """POST `body` to `path` (under the base URL) and return the whole answer."""
        conn = await self._exchange(self._request(path, body), streaming=False)
        parts = conn.body
        reply = Reply(conn.status, conn.headers, parts[0] if len(parts) == 1 else b"".join(parts))
        self._release(conn)
        return reply

    async def open(self, path: str, body: bytes) -> Response:
        """POST `body` to `path` and return once the answer's head is in; its body is read as it arrives."""
        return Response(self, await self._exchange(self._request(path, body), streaming=True))

    async def _exchange(self, data: bytes, streaming: bool) -> _Connection:
        """Send the request and wait for the answer's head (streamed) or all of it. A reused connection the server
        had closed in the meantime (it answers nothing) gets the request once more, on a new connection."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        fresh = False
        while True:
            conn = await self._acquire(deadline, fresh)
            try:
                conn.start(data, deadline, streaming)
                await (conn.read_head() if streaming else conn.read_to_end())
            except ConnectionBroken:
                self._discard(conn)
                if conn.reused and not conn.got_bytes and not fresh:
                    fresh = True
                    continue
                raise
            except BaseException:
                self._discard(conn)
                raise
            return conn

    async def _acquire(self, deadline: float, fresh: bool) -> _Connection:
        idle = self._idle
        while True:
            while idle and not fresh:
                conn = idle.pop()
                conn.idle = False
                if conn.lost or conn.transport is None or conn.transport.is_closing():
                    self._discard(conn)
                    continue
                conn.reused = True
                return conn
            if self._count < self.max_connections:
                break
            await self._wait_for_slot(deadline)
        self._count += 1
        try:
            return await self._connect(deadline)
        except BaseException:
            self._count -= 1
            self._wake_one()
            raise

    async def _wait_for_slot(self, deadline: float) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._slot_waiters.append(waiter)
        try:
            async with asyncio.timeout_at(deadline):
                await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._wake_one()  # the slot it was woken for goes to the next in line
            else:
                self._slot_waiters.remove(waiter)
            raise

    def _wake_one(self) -> None:
        waiters = self._slot_waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def _connect(self, deadline: float) -> _Connection:
        loop = asyncio.get_running_loop()
        context = None
        if self._tls:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        async with asyncio.timeout_at(min(deadline, loop.time() + self.connect_timeout_s)):
            _, conn = await loop.create_connection(
                lambda: _Connection(self),
                self.host,
                self.port,
                ssl=context,
                server_hostname=self.host if context is not None else None,
            )
        self.opened += 1
        return conn

    def _release(self, conn: _Connection) -> None:
        """The exchange on `conn` ended with its message read whole: keep the connection if it may be reused."""
        conn.end()
        if not conn.keep_alive or conn.lost or conn.generation != self.generation:
            self._discard(conn)
            return
        conn.idle = True
        conn.idle_since = asyncio.get_running_loop().time()
        self._idle.append(conn)
        if self._sweeper is None:
            self._schedule_sweep()
        self._wake_one()

    def _discard(self, conn: _Connection) -> None:
        """Close `conn` and free its slot (once, however often it is called)."""
        conn.end()
        conn.keep_alive = False
        if conn.idle:
            conn.idle = False
            self._idle.remove(conn)
        conn.abort()
        if conn.counted:
            conn.counted = False
            self._count -= 1
            self._wake_one()

    def _schedule_sweep(self) -> None:
        oldest = self._idle[0].idle_since
        self._sweeper = asyncio.get_running_loop().call_at(oldest + self.idle_timeout_s, self._sweep)

    def _sweep(self) -> None:
        """Close the connections idle for `idle_timeout_s` (the oldest are first in the list)."""
        self._sweeper = None
        idle = self._idle
        now = asyncio.get_running_loop().time()
        while idle and idle[0].idle_since + self.idle_timeout_s <= now:
            self._discard(idle[0])
        if idle:
            self._schedule_sweep()

    async def close(self) -> None:
        """Close every idle connection; those in use are closed when their exchange ends. The client stays usable."""
        self.generation += 1
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conn in list(self._idle):
            self._discard(conn)
