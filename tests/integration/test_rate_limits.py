"""Per-key rate limits on a real gateway: OpenAI's 429 and headers, the SDK's retry, nothing written when refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import httpx2
import openai

from tests.conftest import query
from tests.support.gateway_server import GatewayServer
from tests.support.openai_schema import validate

MakeGateway = Callable[..., GatewayServer]
BODY = {"model": "scripted-1", "messages": [{"role": "user", "content": "hello"}]}
KEYS = ["key-one", "key-two"]
LIMIT_HEADERS = ("limit", "remaining", "reset")


def post(
    gw: GatewayServer, key: str | None, path: str = "/v1/chat/completions", **fields: Any
) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(gw.url + path, json={**BODY, **fields}, headers=headers, timeout=30)


def call_count(gw: GatewayServer, url: str) -> int:
    gw.flush()
    return int(query(url, "SELECT count(*) AS n FROM calls")[0]["n"])


def test_requests_limit_answers_openais_429_and_writes_nothing(
    make_gateway: MakeGateway, database_url: str
) -> None:
    gw = make_gateway(database_url, api_keys=KEYS, rate_limit_rpm=2)
    first, second, refused = (post(gw, "key-one") for _ in range(3))
    assert [first.status_code, second.status_code, refused.status_code] == [200, 200, 429]
    # Successful answers carry the headers too, counting down.
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert [r.headers["x-ratelimit-remaining-requests"] for r in (first, second)] == ["1", "0"]
    assert "x-ratelimit-limit-tokens" not in first.headers  # no token limit configured

    error = refused.json()
    validate("ErrorResponse", error)
    assert error["error"]["type"] == "requests" and error["error"]["code"] == "rate_limit_exceeded"
    assert "key-one" not in error["error"]["message"]  # named by its hash, never by the key itself
    # One request refills in 60 s / 2 = 30 s (a little less has passed since the second call).
    retry_ms = int(refused.headers["retry-after-ms"])
    assert 25_000 < retry_ms <= 30_000
    assert refused.headers["retry-after"] == str(-(-retry_ms // 1000))
    assert refused.headers["x-ratelimit-limit-requests"] == "2"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.headers["x-ratelimit-reset-requests"].endswith("s")
    assert "x-request-id" not in refused.headers  # no call was made

    # Another key has its own bucket; /v1/models counts against the same limit; admin and feedback are exempt.
    assert post(gw, "key-two").status_code == 200
    models = httpx.get(gw.url + "/v1/models", headers={"authorization": "Bearer key-one"})
    assert models.status_code == 429
    assert httpx.get(gw.url + "/healthz").status_code == 200
    assert call_count(gw, database_url) == 3  # the refused call left no row


def test_sdk_retries_after_a_429_and_succeeds(make_gateway: MakeGateway, tmp_path: Path) -> None:
    # Two requests per 4 s window: a refused call is admitted again within two seconds.
    gw = make_gateway(f"sqlite:///{tmp_path}/sdk.db", rate_limit_rpm=2, rate_limit_window_s=4.0)
    statuses: list[int] = []
    # openai-python 3 sends through HTTPX2; an app that hooks its client passes one of those.
    http = httpx2.Client(event_hooks={"response": [lambda r: statuses.append(r.status_code)]})
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="sdk-key", max_retries=3, http_client=http)
    replies = []
    while 429 not in statuses:  # bounded: a third call within two seconds of two others is refused
        assert len(replies) < 20, "no call was ever refused"
        replies.append(client.chat.completions.create(model="scripted-1", messages=BODY["messages"]))
    # The refused call was retried once, after exactly `retry-after-ms`, and served.
    assert statuses[-2:] == [429, 200]
    assert all(reply.choices[0].message.content for reply in replies)
    raw = client.chat.completions.with_raw_response.create(model="scripted-1", messages=BODY["messages"])
    assert raw.headers["x-ratelimit-limit-requests"] == "2"


def test_tokens_limit_refuses_once_usage_spent_the_budget(
    make_gateway: MakeGateway, database_url: str
) -> None:
    tpm = 2
    gw = make_gateway(database_url, api_keys=KEYS, rate_limit_tpm=tpm)
    first = post(gw, "key-one")
    assert first.status_code == 200
    used = first.json()["usage"]["total_tokens"]
    assert used > tpm  # the call is served (nothing is estimated up front), then charged
    assert first.headers["x-ratelimit-limit-tokens"] == str(tpm)
    assert first.headers["x-ratelimit-remaining-tokens"] == str(tpm)  # as admitted, before this call's usage

    refused = post(gw, "key-one")
    assert refused.status_code == 429
    validate("ErrorResponse", refused.json())
    assert refused.json()["error"]["type"] == "tokens"
    assert refused.headers["x-ratelimit-remaining-tokens"] == "0"
    # Back to one token: the debt (used - tpm) plus one, at tpm tokens per 60 s.
    retry_s = int(refused.headers["retry-after-ms"]) / 1000
    expected_s = (used - tpm + 1) * 60 / tpm
    assert expected_s - 5 < retry_s <= expected_s

    streamed = post(gw, "key-two", stream=True)  # a stream's usage is charged as well
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    assert post(gw, "key-two").json()["error"]["type"] == "tokens"
    assert call_count(gw, database_url) == 2


def test_callers_without_a_key_share_their_address_bucket(make_gateway: MakeGateway, tmp_path: Path) -> None:
    gw = make_gateway(f"sqlite:///{tmp_path}/anon.db", rate_limit_rpm=1)
    assert post(gw, None).status_code == 200
    assert post(gw, None).status_code == 429
    # An open gateway accepts any token, so a token is no identity: a new one per call is still this address.
    assert [post(gw, f"made-up-{i}").status_code for i in range(3)] == [429] * 3


def test_guessed_keys_count_against_the_guessers_address(make_gateway: MakeGateway, tmp_path: Path) -> None:
    gw = make_gateway(f"sqlite:///{tmp_path}/guess.db", api_keys=KEYS, rate_limit_rpm=2)
    assert [post(gw, f"guess-{i}").status_code for i in range(4)] == [401, 401, 429, 429]
    assert post(gw, "key-one").status_code == 200  # a known key keeps its own bucket


def test_no_limits_no_headers(make_gateway: MakeGateway, tmp_path: Path) -> None:
    gw = make_gateway(f"sqlite:///{tmp_path}/off.db")
    reply = post(gw, "key-one")
    assert reply.status_code == 200
    assert not [name for name in reply.headers if name.startswith("x-ratelimit")]
