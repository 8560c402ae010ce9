"""The chat route is served twice over: by a bare ASGI app, and through Litestar for a browser's call when CORS
is on. Both must answer alike and capture alike."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx

from tests.integration.test_chat_capture import calls
from tests.support.gateway_server import GatewayServer

MakeGateway = Callable[..., GatewayServer]
ORIGIN = "https://app.example"
KEY = "route-key"


def chat(gw: GatewayServer, text: str, *, stream: bool = False, origin: bool = False) -> httpx.Response:
    headers = {"authorization": f"Bearer {KEY}", "x-request-id": f"client-{text}"}
    if origin:
        headers["origin"] = ORIGIN
    body = {"model": "scripted-1", "messages": [{"role": "user", "content": text}], "stream": stream}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=10)


def test_a_browser_call_and_a_plain_call_answer_and_capture_alike(
    make_gateway: MakeGateway, database_url: str
) -> None:
    gw = make_gateway(database_url, api_keys=[KEY], cors_origins=[ORIGIN], rate_limit_rpm=1000)
    answers = {
        (origin, stream): chat(
            gw, f"{'browser' if origin else 'plain'}-{'s' if stream else 'j'}", stream=stream, origin=origin
        )
        for origin in (False, True)
        for stream in (False, True)
    }
    for (origin, stream), response in answers.items():
        assert response.status_code == 200, response.text
        assert ("access-control-allow-origin" in response.headers) is origin
        assert response.headers["x-kaizen-model"] == "scripted-1"
        assert response.headers["x-client-request-id"].startswith("client-")
        assert response.headers["x-ratelimit-limit-requests"] == "1000"
        if stream:
            assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
            assert response.headers["cache-control"] == "no-cache"
            events = [line for line in response.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            assert "".join(
                json.loads(e[6:])["choices"][0]["delta"].get("content") or "" for e in events[:-1]
            ).startswith("echo: ")
        else:
            assert response.headers["content-type"] == "application/json"
            assert response.json()["choices"][0]["message"]["content"].startswith("echo: ")
    rows = calls(gw, database_url)
    assert sorted(str(row["client_request_id"]) for row in rows) == sorted(
        r.headers["x-client-request-id"] for r in answers.values()
    )
    assert {row["id"] for row in rows} == {r.headers["x-request-id"] for r in answers.values()}
    assert all(row["status"] == "ok" for row in rows)


def test_refusals_are_the_same_on_both_paths(make_gateway: MakeGateway, database_url: str) -> None:
    gw = make_gateway(database_url, api_keys=[KEY], cors_origins=[ORIGIN])
    for origin in (False, True):
        headers = {"origin": ORIGIN} if origin else {}
        unauthenticated = httpx.post(gw.url + "/v1/chat/completions", json={}, headers=headers, timeout=10)
        assert unauthenticated.status_code == 401
        assert unauthenticated.json()["error"]["code"] == "invalid_api_key"
        headers["authorization"] = f"Bearer {KEY}"
        invalid = httpx.post(
            gw.url + "/v1/chat/completions",
            json={"model": "scripted-1", "messages": 3},
            headers=headers,
            timeout=10,
        )
        assert invalid.status_code == 400 and invalid.json()["error"]["param"] == "messages"
        unknown = httpx.post(
            gw.url + "/v1/chat/completions",
            json={"model": "nope", "messages": [{"role": "user", "content": "x"}]},
            headers=headers,
            timeout=10,
        )
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert calls(gw, database_url) == []
