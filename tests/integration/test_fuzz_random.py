"""Seeded bursts of random malformed requests (`tests/fuzz/random_requests.py`): no 5xx, every 4xx in shape, and
nothing outside OpenAI's spec passed on to a real engine."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import huggingface_hub.constants
import pytest

from tests.conftest import VLLMServer
from tests.fuzz.random_requests import (
    ADMIN_KEY,
    API_KEY,
    ENGINE_TARGETS,
    GENERATION_CAP,
    Fuzzer,
    capped,
    without_images,
)
from tests.support.gateway_server import GatewayServer
from tests.support.openai_schema import request_errors

REQUESTS = 2000
#: The burst on the real engine: each request that reaches it generates (up to a small cap) on the CPU. 500 took
#: 135 s of the suite's serial pass on an idle 2-core machine and 331 s on a slow one; the routes and mutations
#: are the same as in the larger burst above, which runs against the scripted upstream.
ENGINE_REQUESTS = 200
SEED = 20261128


@pytest.mark.slow
def test_random_requests_get_no_5xx_and_every_4xx_in_openai_shape(
    make_gateway: Callable[..., GatewayServer], database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A random base model name is looked up on the hub: offline, the loader refuses it at once rather than after
    # its retries. The default base model is one that fails to load, so no policy build takes minutes.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    gw = make_gateway(database_url, api_keys=[API_KEY], admin_key=ADMIN_KEY, base_model="/no/such/model")
    report = Fuzzer(gw.url, SEED).run(requests=REQUESTS)
    assert report.failures == []
    assert report.sent == REQUESTS
    # The burst reached both sides: requests served and requests refused.
    assert report.statuses[200] > REQUESTS // 20 and report.statuses[400] > REQUESTS // 4, report.statuses


def test_the_bodies_sent_to_the_engine_are_within_the_spec_before_mutation() -> None:
    # The spec check below blames the mutation for a request outside the spec: the bodies it starts from must
    # conform, with their images and without.
    for target in ENGINE_TARGETS:
        assert target.spec is not None
        for body in (target.body, without_images(target).body):
            assert request_errors(target.spec, body) == [], target.path


def test_a_generation_request_that_lost_its_token_limit_gets_a_small_one() -> None:
    # A limit set to null lets the engine generate up to the model's context: one such request took 98 s on CPU
    # vLLM and pushed the burst below past its timeout.
    for target in ENGINE_TARGETS:
        if target.limit is None:
            continue
        deleted = {k: v for k, v in target.body.items() if k != target.limit}
        null = {**target.body, target.limit: None}
        assert capped(target, deleted)[target.limit] == GENERATION_CAP, target.path
        assert capped(target, null)[target.limit] == GENERATION_CAP, target.path
        assert capped(target, {**target.body, target.limit: 2}) == {**target.body, target.limit: 2}
        assert capped(target, [target.body]) == [target.body]


def test_the_unmutated_bodies_sent_to_a_real_engine_carry_a_token_limit() -> None:
    # The burst first checks that each route's unmutated body is served. The streamed Responses body has no limit
    # of its own: sent as it is, CPU vLLM generated to the model's context for 186 s of a 500-request burst.
    sent: list[Any] = []

    def gateway(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, json={})

    fuzzer = Fuzzer("http://gateway.invalid", SEED, targets=ENGINE_TARGETS, real_engine=True)
    fuzzer.client.close()
    fuzzer.client = httpx.Client(base_url="http://gateway.invalid", transport=httpx.MockTransport(gateway))
    fuzzer._check_bases()
    assert len(sent) == len(ENGINE_TARGETS)
    for target, body in zip(ENGINE_TARGETS, sent, strict=True):
        assert target.limit is not None
        assert isinstance(body[target.limit], int) and body[target.limit] <= GENERATION_CAP * 2, target.path


@pytest.mark.vllm
@pytest.mark.timeout(600)  # a single answer over 30 s fails it sooner
def test_random_requests_to_real_vllm_get_no_5xx_and_stay_within_the_spec(
    make_gateway: Callable[..., GatewayServer], vllm_server: VLLMServer, tmp_path: Path
) -> None:
    # A gateway of its own (its own database, keys required) attached to the session's vLLM, so the burst leaves
    # the shared gateway's state alone; only the routes that reach the engine are written to.
    gw = make_gateway(
        f"sqlite:///{tmp_path / 'fuzz.db'}",
        engine="vllm",
        vllm_url=vllm_server.url,
        base_model=vllm_server.model,
        api_keys=[API_KEY],
        admin_key=ADMIN_KEY,
    )
    fuzzer = Fuzzer(gw.url, SEED, model=vllm_server.model, targets=ENGINE_TARGETS, real_engine=True)
    report = fuzzer.run(requests=ENGINE_REQUESTS)
    assert report.failures == []
    assert report.spec_gaps == []
    # Real generations, and requests vLLM itself refused, each checked against the spec.
    assert report.statuses[200] > ENGINE_REQUESTS // 20 and report.engine_refusals > 0, report
