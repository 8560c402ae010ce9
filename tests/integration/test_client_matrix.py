"""The client matrix (tests/clients/matrix.py): every client case against the scripted upstream on SQLite and
PostgreSQL, and the main ones against vLLM with the embedded model. Besides what the client sees, each case
checks what was captured: its calls, all in one episode, at positions 0, 1, ... in the order they were made,
each served through the API the case names (a Responses call leaves its stored response, a chat call none)."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.clients.matrix import CASES, NODE_DIR, Case, Target, ai_sdk_tool_loop
from tests.conftest import VLLMServer, query
from tests.support.gateway_server import GatewayServer
from tests.support.scripted_upstream import ScriptedUpstream


@pytest.fixture(scope="session")
def node_clients() -> Path:
    """The Node clients, installed from their lock file (`npm ci`) unless that install is already there."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.fail("Node.js and npm are needed for the client matrix (Debian's nodejs and npm packages)")
    installed = NODE_DIR / "node_modules" / ".package-lock.json"
    lock = NODE_DIR / "package-lock.json"
    if not installed.is_file() or installed.stat().st_mtime < lock.stat().st_mtime:
        subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund", "--prefer-offline"],
            cwd=NODE_DIR,
            check=True,
            timeout=600,
        )
    return NODE_DIR


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres_twin)])
def scripted(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, upstream: ScriptedUpstream
) -> Iterator[tuple[Target, GatewayServer]]:
    """One gateway per database for the whole module, in front of the scripted upstream."""
    from gateway.settings import Settings

    data = tmp_path_factory.mktemp(f"matrix-{request.param}")
    if request.param == "sqlite":
        url = f"sqlite:///{data / 'kaizen.db'}"
    else:
        url = request.getfixturevalue("postgres").create_database(
            f"matrix_{data.name[-6:].replace('-', '_')}"
        )
    settings = Settings.load(
        data_dir=data,
        database_url=url,
        engine="upstream",
        upstream_url=upstream.url,
        upstream_token_ids=True,
        port=0,
        capture_flush_ms=5.0,
        scheduler=False,
    )
    server = GatewayServer(settings).start()
    yield Target("scripted", server.url + "/v1", "scripted-1"), server
    server.stop()


def _rows(gateway: GatewayServer) -> list[dict[str, Any]]:
    gateway.flush()
    return query(
        gateway.settings.database_url,
        "SELECT id, episode_id, position, status, created_at FROM calls ORDER BY created_at, position",
    )


def _stored_responses(gateway: GatewayServer) -> set[str]:
    return {row["id"] for row in query(gateway.settings.database_url, "SELECT id FROM responses")}


def run_and_check_capture(case: Case, target: Target, gateway: GatewayServer) -> None:
    before = {row["id"] for row in _rows(gateway)}
    made = case.run(replace(target, api=case.api))
    new = [row for row in _rows(gateway) if row["id"] not in before]
    assert len(new) == made, json.dumps(new, default=str)
    if made == 0:
        return
    assert {row["status"] for row in new} == {"ok"}
    assert len({row["episode_id"] for row in new}) == 1, "the conversation split into several episodes"
    assert [row["position"] for row in new] == list(range(made))
    # Every Responses call stores its response (the clients leave `store` at its default); chat calls none.
    stored = {f"resp_{row['id']}" for row in new} & _stored_responses(gateway)
    assert len(stored) == (made if case.api == "responses" else 0), case.api


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_client_on_the_scripted_upstream(
    case: Case, scripted: tuple[Target, GatewayServer], node_clients: Path
) -> None:
    target, gateway = scripted
    run_and_check_capture(case, target, gateway)


VLLM_CASES = [c for c in CASES if c.vllm]


@pytest.mark.vllm
@pytest.mark.parametrize("case", VLLM_CASES, ids=[c.id for c in VLLM_CASES])
def test_client_on_vllm(case: Case, vllm_server: VLLMServer, node_clients: Path) -> None:
    target = Target("vllm", vllm_server.gateway.url + "/v1", vllm_server.model)
    run_and_check_capture(case, target, vllm_server.gateway)


def test_an_ai_sdk_responses_tool_loop_is_one_episode_though_it_re_serialises(
    scripted: tuple[Target, GatewayServer], node_clients: Path
) -> None:
    """What the matrix's AI SDK Responses loop exercises: the SDK keeps no stored state (no
    `previous_response_id`), sends the whole input back each step, and re-serialises the tool call's arguments
    (`{"city":"Paris"}` for the engine's `{"city": "Paris"}`); the conversation still stitches into one episode."""
    target, gateway = scripted
    before = {row["id"] for row in _rows(gateway)}
    assert ai_sdk_tool_loop(replace(target, api="responses")) == 2
    gateway.flush()
    first, second = (
        row
        for row in query(
            gateway.settings.database_url,
            "SELECT c.id, c.episode_id, c.request, c.response, r.previous_response_id FROM calls c "
            "JOIN responses r ON r.call_id = c.id ORDER BY c.created_at",
        )
        if row["id"] not in before
    )
    for row in (first, second):
        for column in ("request", "response"):
            if isinstance(row[column], str):  # JSON columns come back as text from SQLite
                row[column] = json.loads(row[column])
    [answered] = first["response"]["choices"][0]["message"]["tool_calls"]
    sent_back = second["request"]["messages"]
    assert second["previous_response_id"] is None
    assert sent_back[0] == first["request"]["messages"][0]
    [echoed] = sent_back[1]["tool_calls"]
    assert echoed["id"] == answered["id"]
    assert echoed["function"]["arguments"] != answered["function"]["arguments"]
    assert json.loads(echoed["function"]["arguments"]) == json.loads(answered["function"]["arguments"])
    assert sent_back[2]["role"] == "tool" and sent_back[2]["tool_call_id"] == answered["id"]
    assert first["episode_id"] == second["episode_id"]
