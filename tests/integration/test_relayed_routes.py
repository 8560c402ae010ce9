"""`GET /v1/models/{id}`, `/v1/completions` (captured as one-turn trajectories) and `/v1/embeddings` (captured
only when configured), through the official `openai` SDK on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from tests.integration.test_chat_capture import calls
from tests.integration.test_keys_and_tenancy import ADMIN, create_key
from tests.support.gateway_server import GatewayServer
from tests.support.openai_schema import validate
from tests.support.scripted_upstream import text_token_ids, token_logprob

MakeGateway = Callable[..., GatewayServer]


def sdk(gw: GatewayServer, key: str = "sk-env", **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, default_headers=headers)


def gateway(make_gateway: MakeGateway, url: str, **overrides: Any) -> GatewayServer:
    return make_gateway(url, **{"api_keys": ["sk-env"], "admin_key": "adm", **overrides})


def test_retrieve_a_model(make_gateway: MakeGateway, database_url: str) -> None:
    gw = gateway(make_gateway, database_url)
    card = sdk(gw).models.retrieve("scripted-1")
    validate("Model", card.model_dump())
    assert card.id == "scripted-1" and card.object == "model"
    with pytest.raises(openai.NotFoundError) as missing:
        sdk(gw).models.retrieve("no-such-model")
    validate("ErrorResponse", missing.value.response.json())
    assert missing.value.response.json()["error"]["code"] == "model_not_found"
    # A key limited to one model sees no other, as in the list.
    narrow = create_key(gw, "narrow", models=["scripted-2"])["secret"]
    assert sdk(gw, narrow).models.retrieve("scripted-2").id == "scripted-2"
    with pytest.raises(openai.NotFoundError):
        sdk(gw, narrow).models.retrieve("scripted-1")


def test_relayed_routes_need_the_chat_scope(make_gateway: MakeGateway, database_url: str) -> None:
    gw = gateway(make_gateway, database_url)
    reader = create_key(gw, "reader", scopes=["read"])["secret"]
    for method, path, body in (
        ("GET", "/v1/models/scripted-1", None),
        ("POST", "/v1/completions", {"model": "scripted-1", "prompt": "hi"}),
        ("POST", "/v1/embeddings", {"model": "scripted-1", "input": "hi"}),
    ):
        response = httpx.request(
            method, gw.url + path, json=body, headers={"authorization": f"Bearer {reader}"}
        )
        assert response.status_code == 403, (path, response.text)
        assert response.json()["error"]["code"] == "insufficient_scope"
        assert httpx.request(method, gw.url + path, json=body).status_code == 401
    assert calls(gw, database_url) == []


def test_completion_is_captured_as_a_one_turn_trajectory(
    make_gateway: MakeGateway, database_url: str
) -> None:
    gw = gateway(make_gateway, database_url)
    raw = sdk(gw).completions.with_raw_response.create(
        model="scripted-1", prompt="Once upon a time", max_tokens=16
    )
    body = raw.http_response.json()
    validate("CreateCompletionResponse", body)
    assert body["object"] == "text_completion" and body["id"] == f"cmpl-{raw.headers['x-request-id']}"
    reply = "echo: Once upon a time"
    assert body["choices"][0]["text"] == reply and body["choices"][0]["logprobs"] is None
    assert "token_ids" not in body["choices"][0]
    [row] = calls(gw, database_url)
    assert row["id"] == raw.headers["x-request-id"] and row["episode_id"] == raw.headers["x-episode-id"]
    assert row["request"]["prompt"] == "Once upon a time"
    assert row["request"]["params"]["max_tokens"] == 16
    assert row["response"]["choices"] == [{"index": 0, "text": reply, "finish_reason": "stop"}]
    assert row["prompt_token_ids"] == text_token_ids("Once upon a time")
    assert row["completion_token_ids"] == [text_token_ids(reply)]
    assert row["completion_logprobs"] == [[token_logprob(i) for i in range(len(reply.split()))]]
    assert row["position"] == 0
    trajectory = httpx.get(gw.url + f"/v1/episodes/{row['episode_id']}", headers=ADMIN).json()
    assert trajectory["messages"] == [
        {"role": "user", "content": "Once upon a time"},
        {"role": "assistant", "content": reply},
    ]


def test_completions_join_an_episode_only_when_named(make_gateway: MakeGateway, database_url: str) -> None:
    gw = gateway(make_gateway, database_url)
    named = sdk(gw, **{"x-episode-id": "story-1"})
    first = named.completions.with_raw_response.create(model="scripted-1", prompt="Chapter one")
    second = named.completions.with_raw_response.create(model="scripted-1", prompt="Chapter two")
    alone = sdk(gw).completions.with_raw_response.create(model="scripted-1", prompt="Chapter one")
    assert first.headers["x-episode-id"] == second.headers["x-episode-id"] == "story-1"
    assert alone.headers["x-episode-id"] != "story-1"
    rows = calls(gw, database_url)
    assert [(r["episode_id"], r["position"]) for r in rows] == [
        ("story-1", 0),
        ("story-1", 1),
        (alone.headers["x-episode-id"], 0),
    ]
    assert rows[0]["context_hash"] == rows[2]["context_hash"] != rows[1]["context_hash"]


def test_streamed_completion_and_logprobs(make_gateway: MakeGateway, database_url: str) -> None:
    gw = gateway(make_gateway, database_url)
    text, usage = "", None
    for chunk in sdk(gw).completions.create(
        model="scripted-1", prompt="#long 6", stream=True, stream_options={"include_usage": True}
    ):
        body = chunk.model_dump(exclude_unset=True)
        for choice in body["choices"]:
            if choice["finish_reason"] is not None:  # the spec has no `null` here; the API streams it
                validate("CreateCompletionResponse", body)
        text += "".join(c.text for c in chunk.choices)
        usage = chunk.usage or usage
    assert text == "w0 w1 w2 w3 w4 w5"
    assert usage is not None and usage.completion_tokens == 6
    asked = sdk(gw).completions.create(model="scripted-1", prompt="#long 3", logprobs=1)
    logprobs = asked.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs == [token_logprob(i) for i in range(3)]
    rows = calls(gw, database_url)
    assert rows[0]["stream"] and rows[0]["response"]["choices"][0]["text"] == text
    assert rows[0]["completion_token_ids"] == [text_token_ids(text)]


@pytest.mark.parametrize("capture", [False, True])
def test_embeddings_are_relayed_and_captured_only_when_configured(
    make_gateway: MakeGateway, database_url: str, capture: bool
) -> None:
    gw = gateway(make_gateway, database_url, capture_embeddings=capture)
    raw = sdk(gw).embeddings.with_raw_response.create(model="scripted-1", input=["red apple", "green pear"])
    body = raw.http_response.json()
    validate("CreateEmbeddingResponse", body)
    assert [d["index"] for d in body["data"]] == [0, 1] and len(body["data"][0]["embedding"]) == 8
    assert body["usage"] == {"prompt_tokens": 4, "total_tokens": 4}
    rows = calls(gw, database_url)
    if not capture:
        assert rows == []
        return
    [row] = rows
    assert row["id"] == raw.headers["x-request-id"]
    assert row["request"]["input"] == ["red apple", "green pear"]
    assert row["response"] == {"data": [{"index": 0, "dimensions": 8}, {"index": 1, "dimensions": 8}]}
    assert row["usage"] == {"prompt_tokens": 4, "total_tokens": 4}


def test_engine_errors_on_relayed_routes_are_openai_shaped(
    make_gateway: MakeGateway, database_url: str
) -> None:
    gw = gateway(make_gateway, database_url)
    with pytest.raises(openai.BadRequestError) as refused:
        sdk(gw).completions.create(model="scripted-1", prompt="#error 400")
    validate("ErrorResponse", refused.value.response.json())
    [row] = calls(gw, database_url)
    assert row["status"] == "error" and row["error"]["status"] == 400
