"""Where an episode came from, and which task it attempts, set by headers: `X-Kaizen-Source` (admin keys only;
`kaizen bootstrap` sends it) and `X-Kaizen-Group-Key` (for clients that set headers more easily than metadata)."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import openai

from tests.conftest import query
from tests.support.gateway_server import GatewayServer

API_KEY = "sk-app"
ADMIN_KEY = "admin-key"
USER = [{"role": "user", "content": "hello"}]


def _post(gw: GatewayServer, key: str, headers: dict[str, str], **body: object) -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": "scripted-1", "messages": USER, **body},
        headers={"authorization": f"Bearer {key}", **headers},
        timeout=10,
    )


def test_source_and_group_key_headers_are_recorded_on_the_episode(
    make_gateway: Callable[..., GatewayServer], database_url: str
) -> None:
    gw = make_gateway(database_url, api_keys=[API_KEY], admin_key=ADMIN_KEY)
    admin = openai.OpenAI(base_url=gw.url + "/v1", api_key=ADMIN_KEY, max_retries=0)
    tagged = admin.chat.completions.with_raw_response.create(
        model="scripted-1",
        messages=USER,
        extra_headers={"X-Kaizen-Source": "bootstrap", "X-Kaizen-Group-Key": "scenario-1"},
    )
    plain = _post(gw, API_KEY, {"X-Kaizen-Group-Key": "from-header"})
    # metadata.group_key wins over the header when a client sends both
    both = _post(gw, API_KEY, {"X-Kaizen-Group-Key": "from-header"}, metadata={"group_key": "from-body"})
    assert plain.status_code == both.status_code == 200
    gw.flush()

    ids = [tagged.headers["x-episode-id"], plain.headers["x-episode-id"], both.headers["x-episode-id"]]
    rows = {
        r["id"]: (r["source"], r["group_key"])
        for r in query(database_url, "SELECT id, source, group_key FROM episodes")
    }
    assert [rows[i] for i in ids] == [
        ("bootstrap", "scenario-1"),
        ("traffic", "from-header"),
        ("traffic", "from-body"),
    ]
    [call] = query(
        database_url, "SELECT group_key FROM calls WHERE id = :id", id=tagged.headers["x-request-id"]
    )
    assert call["group_key"] == "scenario-1"
    episode = httpx.get(
        f"{gw.url}/v1/episodes/{ids[0]}", headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=10
    ).json()
    assert (episode["source"], episode["group_key"]) == ("bootstrap", "scenario-1")


BAD = [
    (API_KEY, {"X-Kaizen-Source": "bootstrap"}, 403, "source_not_allowed"),
    (ADMIN_KEY, {"X-Kaizen-Source": "Bootstrap Run"}, 400, "invalid_source"),
    (ADMIN_KEY, {"X-Kaizen-Source": "x" * 33}, 400, "invalid_source"),
    (API_KEY, {"X-Kaizen-Group-Key": "k" * 257}, 400, "invalid_group_key"),
]


def test_bad_source_and_group_key_headers_are_refused_and_nothing_is_written(
    make_gateway: Callable[..., GatewayServer], database_url: str
) -> None:
    gw = make_gateway(database_url, api_keys=[API_KEY], admin_key=ADMIN_KEY)
    answers = [(r.status_code, r.json()["error"]["code"]) for r in (_post(gw, k, h) for k, h, _, _ in BAD)]
    assert answers == [(status, code) for _, _, status, code in BAD]
    gw.flush()
    assert query(database_url, "SELECT count(*) AS n FROM calls")[0]["n"] == 0


def test_the_headers_apply_to_responses_calls_too(
    make_gateway: Callable[..., GatewayServer], database_url: str
) -> None:
    """Agent frameworks on the Responses API set them the same way; a refused header writes nothing there
    either (no call, no stored response)."""
    gw = make_gateway(database_url, api_keys=[API_KEY], admin_key=ADMIN_KEY)
    admin = openai.OpenAI(base_url=gw.url + "/v1", api_key=ADMIN_KEY, max_retries=0)
    tagged = admin.responses.with_raw_response.create(
        model="scripted-1",
        input="hello",
        extra_headers={"X-Kaizen-Source": "bootstrap", "X-Kaizen-Group-Key": "scenario-2"},
    )
    refused = httpx.post(
        gw.url + "/v1/responses",
        json={"model": "scripted-1", "input": "hello"},
        headers={"authorization": f"Bearer {API_KEY}", "X-Kaizen-Source": "bootstrap"},
        timeout=10,
    )
    assert (refused.status_code, refused.json()["error"]["code"]) == (403, "source_not_allowed")
    gw.flush()
    [episode] = query(database_url, "SELECT id, source, group_key FROM episodes")
    assert (episode["id"], episode["source"], episode["group_key"]) == (
        tagged.headers["x-episode-id"],
        "bootstrap",
        "scenario-2",
    )
    [call] = query(database_url, "SELECT id, group_key FROM calls")
    assert (call["id"], call["group_key"]) == (tagged.headers["x-request-id"], "scenario-2")
    assert [r["id"] for r in query(database_url, "SELECT id FROM responses")] == [tagged.parse().id]
