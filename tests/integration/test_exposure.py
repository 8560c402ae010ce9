"""Safe defaults: no open gateway on the network by accident, no cross-origin simple requests, no CORS unasked."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from gateway.exposure import open_exposure
from gateway.settings import Settings
from tests.conftest import query
from tests.support.gateway_server import GatewayServer
from tests.support.openai_schema import validate
from tests.support.polling import wait_until
from tests.support.ports import free_port
from tests.support.scripted_upstream import ScriptedUpstream

MakeGateway = Callable[..., GatewayServer]
BODY = b'{"model": "scripted-1", "messages": [{"role": "user", "content": "hi"}]}'


@pytest.mark.parametrize(
    ("overrides", "refused"),
    [
        ({"host": "127.0.0.1"}, False),
        ({"host": "::1"}, False),
        ({"host": "localhost"}, False),
        ({"host": "0.0.0.0"}, True),
        ({"host": "::"}, True),
        ({"host": "gateway.internal"}, True),
        ({"host": "0.0.0.0", "api_keys": "k1"}, False),
        ({"host": "0.0.0.0", "allow_open": True}, False),
    ],
)
def test_open_exposure(overrides: dict[str, object], refused: bool) -> None:
    assert (open_exposure(Settings.load(**overrides)) is not None) == refused


def test_serve_refuses_a_public_address_without_keys(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAIZEN_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    command = [sys.executable, "-m", "gateway", "serve", "--host", "0.0.0.0", "--port", "0"]
    process = subprocess.Popen(
        [*command, "--data-dir", str(tmp_path / "data")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:  # it must not be serving: stop it whatever the assertion says
            process.kill()
            process.wait()
    assert process.returncode == 2, output
    assert "refusing to serve on 0.0.0.0" in output and "KAIZEN_API_KEYS" in output
    assert "KAIZEN_ALLOW_OPEN=true" in output
    assert not (tmp_path / "data").exists()  # refused before touching anything


def test_serve_on_a_public_address_with_managed_keys_starts(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAIZEN_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    data = ["--data-dir", str(tmp_path / "data")]
    created = subprocess.run(
        [sys.executable, "-m", "gateway", "keys", "create", "app", *data],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert created.returncode == 0, created.stderr
    port = free_port()
    engine = ["--engine", "upstream", "--upstream-url", upstream.url, "--no-scheduler"]
    command = [sys.executable, "-m", "gateway", "serve", "--host", "0.0.0.0", "--port", str(port), *engine]
    process = subprocess.Popen(
        [*command, *data], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )

    def healthy() -> bool:
        assert process.poll() is None, process.communicate()[0]
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(healthy, "the gateway to serve on 0.0.0.0", timeout_s=120)
        # Closed by the managed key: a call without it is refused.
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).status_code == 401
    finally:
        process.kill()
        process.wait()


@pytest.mark.parametrize(
    "headers",
    [
        {"content-type": "text/plain"},
        {"content-type": "text/plain;charset=UTF-8"},
        {"content-type": "application/x-www-form-urlencoded"},
        {"content-type": "multipart/form-data; boundary=x"},
        {},
    ],
)
def test_bodies_not_declared_json_are_refused_unread(
    make_gateway: MakeGateway, database_url: str, upstream: ScriptedUpstream, headers: dict[str, str]
) -> None:
    gw = make_gateway(database_url)
    before = len(upstream.requests)
    for path in ("/v1/chat/completions", "/v1/feedback"):
        response = httpx.post(gw.url + path, content=BODY, headers=headers, timeout=10)
        assert response.status_code == 415, response.text
        validate("ErrorResponse", response.json())
        assert response.json()["error"]["code"] == "unsupported_media_type"
    gw.flush()
    assert len(upstream.requests) == before
    assert query(database_url, "SELECT id FROM calls") == []
    assert query(database_url, "SELECT id FROM rewards") == []
    ok = httpx.post(
        gw.url + "/v1/chat/completions",
        content=BODY,
        headers={"content-type": "application/json; charset=utf-8"},
        timeout=10,
    )
    assert ok.status_code == 200, ok.text


def test_cors_is_off_unless_origins_are_configured(make_gateway: MakeGateway, database_url: str) -> None:
    origin = {"origin": "https://app.example"}
    closed = make_gateway(database_url)
    response = httpx.get(closed.url + "/v1/models", headers=origin, timeout=10)
    assert response.status_code == 200 and "access-control-allow-origin" not in response.headers
    preflight = {**origin, "access-control-request-method": "POST"}
    refused = httpx.options(closed.url + "/v1/chat/completions", headers=preflight, timeout=10)
    assert "access-control-allow-origin" not in refused.headers

    opened = make_gateway(database_url, cors_origins=["https://app.example"])
    response = httpx.get(opened.url + "/v1/models", headers=origin, timeout=10)
    assert response.headers["access-control-allow-origin"] == "https://app.example"
    allowed = httpx.options(
        opened.url + "/v1/chat/completions",
        headers={**preflight, "access-control-request-headers": "content-type"},
        timeout=10,
    )
    assert allowed.status_code in (200, 204), allowed.text
    assert allowed.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.get(opened.url + "/v1/models", headers={"origin": "https://evil.example"}, timeout=10)
    assert "access-control-allow-origin" not in other.headers


def test_an_open_loopback_gateway_answers_only_loopback_host_names(
    make_gateway: MakeGateway, tmp_path: Path
) -> None:
    # DNS rebinding: a page on attacker.example re-points its own name at 127.0.0.1, and the visitor's browser
    # then calls the gateway same-origin (no preflight, answers readable), naming attacker.example as the host.
    # A gateway without keys is only safe on loopback if it answers loopback names alone.
    gw = make_gateway(f"sqlite:///{tmp_path / 'hosts.db'}", allowed_hosts=["Gateway.local:8000", "[::2]"])
    body = {"model": "scripted-1", "messages": [{"role": "user", "content": "hi"}]}
    for host in ("attacker.example", f"attacker.example:{gw.port}", "127.0.0.1.attacker.example"):
        refused = httpx.post(gw.url + "/v1/chat/completions", json=body, headers={"host": host}, timeout=10)
        assert refused.status_code == 403, (host, refused.text)
        assert refused.json()["error"]["code"] == "host_not_allowed"
        assert httpx.get(gw.url + "/v1/models", headers={"host": host}, timeout=10).status_code == 403
    assert query(f"sqlite:///{tmp_path / 'hosts.db'}", "SELECT count(*) AS n FROM calls")[0]["n"] == 0
    for host in (
        f"127.0.0.1:{gw.port}",
        f"localhost:{gw.port}",
        f"localhost.:{gw.port}",
        "[::1]",
        "LOCALHOST",
        "gateway.local",  # a configured name, compared without its port
        "[::2]:9",
    ):
        served = httpx.post(gw.url + "/v1/chat/completions", json=body, headers={"host": host}, timeout=10)
        assert served.status_code == 200, (host, served.text)
    # With keys, a rebinding page has none to send: any host name is answered (a proxy's, say).
    keyed = make_gateway(f"sqlite:///{tmp_path / 'keyed.db'}", api_keys=["k"])
    answered = httpx.post(
        keyed.url + "/v1/chat/completions",
        json=body,
        headers={"host": "gateway.example", "authorization": "Bearer k"},
        timeout=10,
    )
    assert answered.status_code == 200, answered.text
