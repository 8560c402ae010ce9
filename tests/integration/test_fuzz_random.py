"""A seeded burst of random malformed requests (`tests/fuzz/random_requests.py`): no 5xx, every 4xx in shape."""

from __future__ import annotations

from collections.abc import Callable

import huggingface_hub.constants
import pytest

from tests.fuzz.random_requests import ADMIN_KEY, API_KEY, Fuzzer
from tests.support.gateway_server import GatewayServer

REQUESTS = 2000
SEED = 20261128


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
