"""The engine's HTTP/1.1 client (`gateway.engines.http1`) through `OpenAIHTTPClient`, against small scripted
servers on loopback: framing, keep-alive, the error mapping, SSE streams, timeouts, cancellation and TLS.

Every test runs on asyncio's own loop and on uvloop (the serving process's loop)."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import uvloop

from gateway.engines.http import OpenAIHTTPClient, _SSEStream
from gateway.engines.http1 import HTTP1Client
from gateway.errors import (
    APIError,
    EngineBadResponse,
    EngineDisconnected,
    EngineError,
    EngineTimeout,
    EngineUnavailable,
    InvalidRequest,
)
from tests.support.polling import wait_until_async
from tests.support.ports import free_port

Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
Run = Callable[[Coroutine[Any, Any, None]], None]
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
REPLY = {"id": "chatcmpl-1", "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}}]}


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Run:
    def runner(coro: Coroutine[Any, Any, None]) -> None:
        if request.param == "uvloop":
            uvloop.run(coro)
        else:
            asyncio.run(coro)

    return runner


def response(status: int = 200, body: bytes | None = None, headers: dict[str, str] | None = None) -> bytes:
    data = json.dumps(REPLY).encode() if body is None else body
    lines = [f"HTTP/1.1 {status} X", f"Content-Length: {len(data)}", "Content-Type: application/json"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


def chunked(*pieces: bytes, end: bool = True) -> bytes:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    body = b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces)
    return head + body + (b"0\r\n\r\n" if end else b"")


def sse(*events: Any, done: bool = True) -> bytes:
    lines = [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events]
    return b"".join(lines) + (b"data: [DONE]\n\n" if done else b"")


def send(data: bytes, close: bool = False) -> Answer:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(data)
        await writer.drain()
        if close:
            writer.close()

    return answer


async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer nothing until the client closes the connection."""
    await reader.read()


class Upstream:
    """A loopback server: the n-th request gets `answers[n]` (the last one repeats); it records every request and
    counts connections, and which of them the client closed."""

    def __init__(self, *answers: Answer, tls: ssl.SSLContext | None = None) -> None:
        self.answers = list(answers)
        self.tls = tls
        self.requests: list[tuple[bytes, bytes]] = []
        self.connections = 0
        self.client_closed = 0
        self.got_request = asyncio.Event()
        self.port = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    self.client_closed += 1
                    return
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                self.requests.append((head, body))
                self.got_request.set()
                answer = self.answers[min(len(self.requests), len(self.answers)) - 1]
                await answer(reader, writer)
                if writer.is_closing():
                    return
        finally:
            writer.close()

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Upstream]:
        server = await asyncio.start_server(self.serve, "127.0.0.1", 0, ssl=self.tls)
        self.port = server.sockets[0].getsockname()[1]
        try:
            yield self
        finally:
            server.close()


def client(upstream: Upstream, **options: Any) -> OpenAIHTTPClient:
    scheme = "https" if upstream.tls else "http"
    return OpenAIHTTPClient(f"{scheme}://127.0.0.1:{upstream.port}/v1", **options)


def test_a_content_length_answer_and_the_request_sent(run: Run) -> None:
    async def main() -> None:
        async with Upstream(send(response())).running() as up:
            engine = client(up, api_key="secret")
            assert await engine.chat(BODY) == REPLY
            await engine.close()
        [(head, body)] = up.requests
        lines = head.decode().split("\r\n")
        assert lines[0] == "POST /v1/chat/completions HTTP/1.1"
        headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:] if line)}
        assert headers == {
            "host": f"127.0.0.1:{up.port}",
            "content-type": "application/json",
            "authorization": "Bearer secret",
            "content-length": str(len(body)),
        }
        assert json.loads(body) == BODY

    run(main())


def test_a_chunked_answer(run: Run) -> None:
    data = json.dumps(REPLY).encode()

    async def main() -> None:
        async with Upstream(send(chunked(data[:5], data[5:9], data[9:]))).running() as up:
            engine = client(up)
            assert await engine.request("/completions", BODY) == REPLY
            assert await engine.chat(BODY) == REPLY
            await engine.close()
        assert up.connections == 1
        assert up.requests[0][0].startswith(b"POST /v1/completions ")

    run(main())


def test_an_answer_framed_by_the_connections_end_is_whole_and_the_connection_not_reused(run: Run) -> None:
    data = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + json.dumps(REPLY).encode()

    async def main() -> None:
        async with Upstream(send(data, close=True)).running() as up:
            engine = client(up)
            assert await engine.chat(BODY) == REPLY
            assert await engine.chat(BODY) == REPLY
            await engine.close()
        assert up.connections == 2

    run(main())


def test_keep_alive_reuses_one_connection(run: Run) -> None:
    async def main() -> None:
        async with Upstream(send(response())).running() as up:
            engine = client(up)
            for _ in range(3):
                assert await engine.chat(BODY) == REPLY
            await engine.close()
            await wait_until_async(_async(lambda: up.client_closed == 1), "the pool's connection closed")
        assert (up.connections, len(up.requests)) == (1, 3)

    run(main())


def test_connection_close_from_the_server_is_not_reused(run: Run) -> None:
    async def main() -> None:
        async with Upstream(send(response(headers={"Connection": "close"}))).running() as up:
            engine = client(up)
            assert await engine.chat(BODY) == REPLY
            assert await engine.chat(BODY) == REPLY
            await engine.close()
        assert up.connections == 2

    run(main())


def test_a_stale_keep_alive_connection_is_retried_once_on_a_new_one(run: Run) -> None:
    async def close_unanswered(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    async def main() -> None:
        async with Upstream(send(response()), close_unanswered, send(response())).running() as up:
            engine = client(up)
            assert await engine.chat(BODY) == REPLY
            assert await engine.chat(BODY) == REPLY  # its first try meets a connection the server closed
            await engine.close()
        assert (up.connections, len(up.requests)) == (2, 3)

    run(main())


def test_other_failures_are_not_retried(run: Run) -> None:
    async def close_unanswered(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    partial = send(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{", close=True)

    async def main() -> None:
        async with Upstream(close_unanswered).running() as up:
            engine = client(up)
            with pytest.raises(EngineUnavailable):  # a new connection closed before any answer
                await engine.chat(BODY)
            await engine.close()
        assert len(up.requests) == 1
        async with Upstream(send(response()), partial).running() as up:
            engine = client(up)
            await engine.chat(BODY)
            with pytest.raises(EngineDisconnected, match="the engine connection broke"):
                await engine.chat(BODY)  # a reused connection that broke mid-answer
            await engine.close()
        assert len(up.requests) == 2

    run(main())


@pytest.mark.parametrize("streamed", [False, True])
def test_error_statuses_map_as_before(run: Run, streamed: bool) -> None:
    def error(message: str) -> bytes:
        return json.dumps({"error": {"message": message, "param": "max_tokens", "code": 400}}).encode()

    answers = [
        send(response(400, error("too long"))),
        send(response(429, error("slow down"), {"Retry-After": "7"})),
        send(response(503, error("busy"), {"Retry-After": "3"})),
        send(response(500, b"boom")),
        send(response(401, error("bad key"))),
    ]

    async def call(engine: OpenAIHTTPClient) -> None:
        if streamed:
            await engine.open_stream(BODY)
        else:
            await engine.chat(BODY)

    async def main() -> None:
        async with Upstream(*answers).running() as up:
            engine = client(up)
            with pytest.raises(InvalidRequest) as bad:
                await call(engine)
            assert (bad.value.status_code, bad.value.param, bad.value.code) == (
                400,
                "max_tokens",
                "engine_400",
            )
            with pytest.raises(APIError) as limited:
                await call(engine)
            assert (limited.value.status_code, limited.value.retry_after) == (429, 7.0)
            with pytest.raises(EngineUnavailable) as busy:
                await call(engine)
            assert busy.value.retry_after == 3.0 and "busy" in busy.value.message
            with pytest.raises(EngineError) as failed:
                await call(engine)
            assert (failed.value.status_code, failed.value.code) == (502, "engine_error")
            assert "boom" in failed.value.message
            with pytest.raises(EngineError) as refused:
                await call(engine)
            assert (refused.value.status_code, refused.value.code) == (502, "engine_auth_failed")
            await engine.close()
        assert up.connections == 1  # error answers are read whole and their connection reused

    run(main())


async def collect(engine: OpenAIHTTPClient) -> list[Any]:
    stream = await engine.open_stream(BODY)
    try:
        return [chunk async for chunk in stream]
    finally:
        await stream.close()


def test_a_stream_over_a_socket_and_its_connection_reused(run: Run) -> None:
    events = [{"n": n, "text": "é" * n} for n in range(20)]
    data = sse(*events)
    pieces = [data[i : i + 7] for i in range(0, len(data), 7)]

    async def main() -> None:
        async with Upstream(send(chunked(*pieces))).running() as up:
            engine = client(up)
            assert await collect(engine) == events
            assert await collect(engine) == events
            await engine.close()
        assert up.connections == 1

    run(main())


class Pieces:
    """A stand-in for a streamed response that hands out fixed pieces of a body."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces
        self.closed: bool | None = None

    async def read_some(self) -> bytes:
        return self.pieces.pop(0) if self.pieces else b""

    def close(self, finished: bool = False) -> None:
        self.closed = finished


def test_sse_lines_split_anywhere_decode_the_same() -> None:
    events = [{"n": 1}, {"text": "a\\nb"}, {"n": 3}]
    data = b": comment\r\n" + sse(*events).replace(b"\n\n", b"\r\n\r\n") + b'data: {"after": 1}\n\n'

    async def main() -> None:
        for cut in range(1, len(data)):
            for step in (1, 3):
                pieces = [data[:cut]] + [data[i : i + step] for i in range(cut, len(data), step)]
                response = Pieces(pieces)
                stream = _SSEStream(response)  # type: ignore[arg-type]
                assert [chunk async for chunk in stream] == events, (cut, step)
                await stream.close()
                assert response.closed is True

    asyncio.run(main())


def test_a_stream_says_whether_its_next_event_came_in_the_same_read() -> None:
    """The relay writes the events of one read together: `ready` must be true exactly while another event (or
    the end) of the last read is left, or the relay would hold an event back waiting for the engine."""
    pieces = [sse({"n": 1}, {"n": 2}, {"n": 3}, done=False), b": keep-alive\n\n", sse({"n": 4}) + b"\n"]

    async def main() -> list[tuple[Any, bool]]:
        stream = _SSEStream(Pieces(pieces))  # type: ignore[arg-type]
        return [(chunk, stream.ready()) async for chunk in stream]

    seen = asyncio.run(main())
    assert seen == [({"n": 1}, True), ({"n": 2}, True), ({"n": 3}, False), ({"n": 4}, True)]


def test_a_stream_that_ends_early_is_a_disconnect(run: Run) -> None:
    async def main() -> None:
        async with Upstream(
            send(chunked(sse({"n": 1}, done=False), end=False), close=True),
            send(chunked(sse({"n": 1}, done=False))),
        ).running() as up:
            engine = client(up)
            seen: list[Any] = []

            async def read_all() -> None:
                stream = await engine.open_stream(BODY)
                try:
                    async for chunk in stream:
                        seen.append(chunk)
                finally:
                    await stream.close()

            with pytest.raises(EngineDisconnected, match="broke mid-stream"):
                await read_all()
            assert seen == [{"n": 1}]
            with pytest.raises(EngineDisconnected, match="ended before it was complete"):
                await collect(engine)
            await engine.close()

    run(main())


def test_a_bad_json_chunk_is_a_bad_response(run: Run) -> None:
    async def main() -> None:
        async with Upstream(send(chunked(b'data: {"n": 1}\n\ndata: {nope\n\n'))).running() as up:
            engine = client(up)
            with pytest.raises(EngineBadResponse):
                await collect(engine)
            await engine.close()

    run(main())


def test_a_refused_connection_is_unavailable_and_logged(run: Run, caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()

    async def main() -> None:
        engine = OpenAIHTTPClient(f"http://127.0.0.1:{port}/v1")
        with pytest.raises(EngineUnavailable, match="the engine is not reachable"):
            await engine.chat(BODY)
        with pytest.raises(EngineUnavailable):
            await engine.open_stream(BODY)
        await engine.close()

    with caplog.at_level(logging.WARNING, logger="gateway.engines.http"):
        run(main())
    assert f"cannot reach the engine at http://127.0.0.1:{port}/v1" in caplog.text


def test_the_total_timeout_drops_the_connection(run: Run) -> None:
    async def main() -> None:
        async with Upstream(hang, send(response())).running() as up:
            engine = client(up, timeout_s=0.3)
            with pytest.raises(EngineTimeout):
                await engine.chat(BODY)
            await wait_until_async(_async(lambda: up.client_closed == 1), "the timed-out connection closed")
            assert await engine.chat(BODY) == REPLY
            await engine.close()
        assert up.connections == 2

    run(main())


def test_the_total_timeout_covers_a_stream(run: Run) -> None:
    async def main() -> None:

        async def start_then_hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(chunked(sse({"n": 1}, done=False), end=False))
            await writer.drain()
            await hang(reader, writer)

        async with Upstream(start_then_hang).running() as up:
            engine = client(up, timeout_s=0.3)
            with pytest.raises(EngineTimeout):
                await collect(engine)
            await wait_until_async(_async(lambda: up.client_closed == 1), "the timed-out connection closed")
            await engine.close()

    run(main())


def test_a_cancelled_call_closes_its_connection(run: Run) -> None:
    async def main() -> None:
        async with Upstream(hang, send(response())).running() as up:
            engine = client(up)
            call = asyncio.create_task(engine.chat(BODY))
            await up.got_request.wait()
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            await wait_until_async(
                _async(lambda: up.client_closed == 1), "the cancelled call's connection closed"
            )
            assert await engine.chat(BODY) == REPLY
            await engine.close()
        assert up.connections == 2

    run(main())


def test_a_stream_closed_before_its_end_drops_the_connection(run: Run) -> None:
    async def main() -> None:

        async def start_then_hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(chunked(sse({"n": 1}, done=False), end=False))
            await writer.drain()
            await hang(reader, writer)

        async with Upstream(start_then_hang, send(response())).running() as up:
            engine = client(up)
            stream = await engine.open_stream(BODY)
            async for chunk in stream:
                assert chunk == {"n": 1}
                break
            await stream.close()
            await wait_until_async(
                _async(lambda: up.client_closed == 1), "the abandoned stream's connection closed"
            )
            assert await engine.chat(BODY) == REPLY
            await engine.close()
        assert up.connections == 2

    run(main())


@pytest.mark.parametrize("end_arrives", [True, False])
def test_a_stream_closed_after_done_waits_briefly_for_its_end(
    run: Run, monkeypatch: pytest.MonkeyPatch, end_arrives: bool
) -> None:
    # `[DONE]` is all the gateway needs, but the connection is reusable only once the message's end is read.
    monkeypatch.setattr("gateway.engines.http1._LINGER_S", 0.2)

    async def main() -> None:
        closed = asyncio.Event()

        async def end_after_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(chunked(sse({"n": 1}), end=False))
            await writer.drain()
            await closed.wait()
            if end_arrives:
                writer.write(b"0\r\n\r\n")
                await writer.drain()
            else:
                await hang(reader, writer)

        async with Upstream(end_after_close, send(response())).running() as up:
            engine = client(up)
            stream = await engine.open_stream(BODY)
            assert [chunk async for chunk in stream] == [{"n": 1}]
            await stream.close()
            closed.set()
            if end_arrives:
                await wait_until_async(
                    _async(lambda: bool(engine._http._idle)), "the connection back in the pool"
                )
            else:
                await wait_until_async(_async(lambda: up.client_closed == 1), "the connection dropped")
            assert await engine.chat(BODY) == REPLY
            await engine.close()
        assert up.connections == (1 if end_arrives else 2)

    run(main())


def test_a_slow_reader_pauses_the_socket_and_still_gets_everything(run: Run) -> None:
    events = [{"n": n, "pad": "x" * 1000} for n in range(2000)]  # about 2 MB

    async def main() -> None:
        async with Upstream(send(chunked(sse(*events)))).running() as up:
            http = HTTP1Client(f"http://127.0.0.1:{up.port}/v1")
            response = await http.open("/chat/completions", b"{}")
            conn = response._conn
            assert conn is not None
            await wait_until_async(_async(lambda: conn.paused), "reading paused")
            data = bytearray()
            while chunk := await response.read_some():
                data += chunk
            assert data == sse(*events)
            assert http._idle == [conn]  # read to its end: back in the pool
            await http.close()

    run(main())


def test_idle_connections_close_after_the_idle_timeout_or_when_the_server_closes_them(run: Run) -> None:
    async def main() -> None:
        async with Upstream(send(response())).running() as up:
            http = HTTP1Client(f"http://127.0.0.1:{up.port}", idle_timeout_s=0.2)
            await asyncio.gather(*(http.fetch("/x", b"{}") for _ in range(3)))
            assert len(http._idle) == 3
            await wait_until_async(_async(lambda: up.client_closed == 3), "the idle connections closed")
            assert http._idle == [] and http._count == 0
        async with Upstream(send(response(), close=True)).running() as up:
            http = HTTP1Client(f"http://127.0.0.1:{up.port}")
            await http.fetch("/x", b"{}")
            await wait_until_async(_async(lambda: not http._idle), "the closed connection left the pool")
            assert (await http.fetch("/x", b"{}")).status == 200
            assert http.opened == 2
            await http.close()

    run(main())


def test_max_connections_queues_the_calls_beyond_it(run: Run) -> None:
    async def main() -> None:
        async with Upstream(send(response())).running() as up:
            engine = client(up, max_connections=2)
            assert await asyncio.gather(*(engine.chat(BODY) for _ in range(10))) == [REPLY] * 10
            await engine.close()
        assert up.connections <= 2

    run(main())


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, written to `directory`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


def test_https_with_a_trusted_certificate(run: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cert, key = self_signed(tmp_path)
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)
    # The client trusts the system's certificates, which OpenSSL reads from SSL_CERT_FILE when it is set.
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))

    async def main() -> None:
        async with Upstream(send(response()), send(chunked(sse({"n": 1}))), tls=server_tls).running() as up:
            engine = client(up)
            assert await engine.chat(BODY) == REPLY
            assert await collect(engine) == [{"n": 1}]
            await engine.close()
        assert up.connections == 1

    run(main())


def test_https_refuses_an_untrusted_certificate(run: Run, tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)

    async def main() -> None:
        async with Upstream(send(response()), tls=server_tls).running() as up:
            engine = client(up)
            with pytest.raises(EngineUnavailable):
                await engine.chat(BODY)
            await engine.close()

    run(main())


def _async(condition: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return condition()

    return check
