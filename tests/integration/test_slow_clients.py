"""Slow clients are cut off: raw sockets against the gateway under real uvicorn (the protocol `kaizen serve` runs)
on loopback, and against `kaizen serve` itself with one and two serving workers, with short read timeouts. A head not finished in time, or a body that stops arriving, gets a 408 in
OpenAI's shape and a closed connection; a client that keeps sending, and a kept-alive connection between
requests, are left alone."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import query
from tests.support.child_gateway import start, upstream_gateway
from tests.support.gateway_server import GatewayServer
from tests.support.openai_schema import validate
from tests.support.scripted_upstream import ScriptedUpstream

MakeGateway = Callable[..., GatewayServer]
HEAD_S = 0.6
BODY_S = 0.6
#: Longest a test waits for the server to act; far above the timeouts, so a slow machine does not fail them.
PATIENCE_S = 20.0
CHAT = json.dumps({"model": "scripted-1", "messages": [{"role": "user", "content": "hi"}]}).encode()


@pytest.fixture
def gateway(make_gateway: MakeGateway, tmp_path: Path) -> GatewayServer:
    return make_gateway(
        f"sqlite:///{tmp_path / 'k.db'}", request_header_timeout_s=HEAD_S, request_body_timeout_s=BODY_S
    )


def connect(gw: GatewayServer | int) -> socket.socket:
    port = gw if isinstance(gw, int) else gw.port
    sock = socket.create_connection(("127.0.0.1", port), timeout=PATIENCE_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (raises on PATIENCE_S without progress). A
    reset ends it too: a server that closes with bytes of ours unread (a byte the client sent as it was cut off)
    resets the connection, after what it sent."""
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def chat_head(length: int, key: str = "") -> bytes:
    authorization = f"Authorization: Bearer {key}\r\n".encode() if key else b""
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + authorization
        + b"Content-Length: "
        + str(length).encode()
        + b"\r\n\r\n"
    )


def read_response(sock: socket.socket) -> tuple[bytes, bytes]:
    """One response with a content-length, read off a connection that stays open: (head, body)."""
    received = b""
    while b"\r\n\r\n" not in received:
        received += sock.recv(65536) or pytest.fail(f"closed after {received!r}")
    head, _, body = received.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += sock.recv(65536) or pytest.fail("closed mid-body")
    return head, body


def assert_408(answer: bytes) -> None:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), answer
    assert b"connection: close" in head.lower()
    error = json.loads(body)
    validate("ErrorResponse", error)
    assert error["error"]["code"] == "request_timeout"


def test_half_a_head_then_silence_gets_408_after_the_head_timeout(gateway: GatewayServer) -> None:
    with connect(gateway) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
        answer = read_until_closed(sock)
    assert time.monotonic() - started >= HEAD_S * 0.9
    assert_408(answer)


def test_a_head_dribbled_byte_by_byte_is_cut_off_though_it_keeps_coming(gateway: GatewayServer) -> None:
    # The head's limit is for the whole head: progress does not extend it (else one byte a second holds forever).
    head = chat_head(len(CHAT))
    with connect(gateway) as sock:
        started = time.monotonic()
        sock.settimeout(HEAD_S / 4)
        answer = b""
        for byte in head:
            try:
                sock.sendall(bytes([byte]))
                answer += sock.recv(65536)  # waits a quarter of the limit, then the next byte
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
            break  # the server answered (and closed)
        sock.settimeout(PATIENCE_S)
        answer += read_until_closed(sock)
    assert time.monotonic() - started < len(head) * HEAD_S / 4  # cut off long before the head was sent
    assert_408(answer)


def test_an_idle_new_connection_is_closed_without_an_answer(gateway: GatewayServer) -> None:
    with connect(gateway) as sock:
        started = time.monotonic()
        assert read_until_closed(sock) == b""
    assert time.monotonic() - started >= HEAD_S * 0.9


def test_a_body_that_stops_arriving_gets_408_and_nothing_is_stored(
    gateway: GatewayServer, tmp_path: Path
) -> None:
    with connect(gateway) as sock:
        sock.sendall(chat_head(len(CHAT)) + CHAT[:10])
        started = time.monotonic()
        answer = read_until_closed(sock)
    assert time.monotonic() - started >= BODY_S * 0.9
    assert_408(answer)
    gateway.flush()
    assert query(f"sqlite:///{tmp_path / 'k.db'}", "SELECT id FROM calls") == []


def test_a_body_sent_slowly_but_steadily_is_answered(gateway: GatewayServer) -> None:
    # The body's limit is the pause between reads: a body that takes three times the limit to arrive, in pieces
    # each well inside it, is not cut off.
    pieces = [CHAT[i : i + 8] for i in range(0, len(CHAT), 8)]
    pause = BODY_S * 3 / len(pieces)
    assert pause < BODY_S / 2
    with connect(gateway) as sock:
        sock.sendall(chat_head(len(CHAT)))
        started = time.monotonic()
        for piece in pieces:
            time.sleep(pause)  # the slow client itself, not a wait for the server
            sock.sendall(piece)
        head, body = read_response(sock)
    assert time.monotonic() - started > BODY_S
    assert head.startswith(b"HTTP/1.1 200 "), head
    assert json.loads(body)["choices"][0]["message"]["content"] == "echo: hi"


def test_a_kept_alive_connection_is_not_cut_off_between_requests(gateway: GatewayServer) -> None:
    # Idle time between requests is uvicorn's keep-alive timeout (5 s), not the head's limit: a client that waits
    # longer than the head's limit before its next request on the same connection is still answered.
    with connect(gateway) as sock:
        for _ in range(3):
            sock.sendall(chat_head(len(CHAT)) + CHAT)
            head, _ = read_response(sock)
            assert head.startswith(b"HTTP/1.1 200 "), head
            sock.settimeout(HEAD_S * 2)
            with pytest.raises(TimeoutError):
                sock.recv(1)  # nothing comes, and the connection stays open meanwhile
            sock.settimeout(PATIENCE_S)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_kaizen_serve_cuts_off_slow_clients_with_its_settings(
    tmp_path: Path, upstream: ScriptedUpstream, workers: str
) -> None:
    child = upstream_gateway(
        tmp_path / "data",
        f"sqlite:///{tmp_path / 'k.db'}",
        upstream.url,
        {
            "KAIZEN_WORKERS": workers,
            "KAIZEN_REQUEST_HEADER_TIMEOUT_S": str(HEAD_S),
            "KAIZEN_REQUEST_BODY_TIMEOUT_S": str(BODY_S),
        },
    )
    try:
        asyncio.run(start(child))
        port = int(child.url.rsplit(":", 1)[1])
        with connect(port) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0")
            assert_408(read_until_closed(sock))
        with connect(port) as sock:
            sock.sendall(chat_head(len(CHAT), child.api_key) + CHAT[:10])
            assert_408(read_until_closed(sock))
    finally:
        child.stop()
