"""`kaizen bootstrap` as a user runs it: the real command in its own process, against a real gateway.

Here the gateway serves through the scripted upstream and the scenario writer is the scripted judge (exact
scenarios); the run writes, attempts and scores scenarios (`--no-train`) and the episodes are stored with
source `bootstrap`. Training on them through the real vLLM engine is `test_bootstrap_engine.py`.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.commands.bootstrap import choose_mode, group_keys
from gateway.settings import async_database_url
from storage.database import Database
from storage.policies import create_policy
from tests.conftest import query
from tests.support.gateway_server import GatewayServer
from tests.support.scripted_judge import ScriptedJudge
from trainer.control.gate import is_held_out

REPO = Path(__file__).resolve().parents[2]
ADMIN_KEY = "boot-admin"
SCENARIOS = ["Name a color.", "Name a fruit that is yellow.", "Name a planet."]


def kaizen(*args: str, admin_key: str = ADMIN_KEY) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAIZEN_")}
    env["KAIZEN_ADMIN_KEY"] = admin_key
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def make_policy(url: str, name: str, config: dict[str, Any]) -> None:
    async def create() -> None:
        database = Database(async_database_url(url))
        try:
            async with database.session() as session:
                await create_policy(session, name, "smollm2-135m-instruct", config)
                await session.commit()
        finally:
            await database.dispose()

    asyncio.run(create())


@pytest.mark.slow
@pytest.mark.parametrize("seed", [None, 100])
def test_bootstrap_writes_attempts_and_scores_scenarios_stored_as_bootstrap_episodes(
    make_gateway: Callable[..., GatewayServer], database_url: str, seed: int | None
) -> None:
    gw = make_gateway(database_url, admin_key=ADMIN_KEY)
    scorer = {"rewards": {"scorer": {"function": "tests.support.reward_functions:length_score"}}}
    make_policy(database_url, "scripted-1", scorer)
    with ScriptedJudge() as writer:
        writer.script.append(json.dumps({"scenarios": [{"message": m} for m in SCENARIOS]}))
        done = kaizen(
            "bootstrap",
            "--policy=scripted-1",
            "--task=Answer with one word.",
            "--scenarios=3",
            "--attempts=2",
            "--no-train",
            f"--gateway-url={gw.url}/v1",
            "--writer-model=writer-model",
            f"--writer-api-base={writer.url}",
            *([f"--seed={seed}"] if seed is not None else []),
        )
        writer_prompt = writer.prompts()[0]
        writer_seeds = [r.get("seed", "no seed") for r in writer.requests]
    assert done.returncode == 0, done.stderr[-3000:]
    assert writer_seeds == [seed if seed is not None else "no seed"]  # its one request: the seed itself
    report = json.loads(done.stdout)
    assert (report["scenarios"], report["episodes"], report["scored_episodes"]) == (3, 6, 6)
    assert report["judge_run"] is not None and report["mode"] is None and report["train_run"] is None
    assert "Answer with one word." in writer_prompt
    assert "3 scenarios written" in done.stderr and "scoring 3 groups" in done.stderr  # progress, logged

    episodes = query(database_url, "SELECT id, source, group_key, metadata FROM episodes ORDER BY group_key")
    assert len(episodes) == 6 and {e["source"] for e in episodes} == {"bootstrap"}
    assert len({e["group_key"] for e in episodes}) == 3
    tags = {
        (json.loads(e["metadata"]) if isinstance(e["metadata"], str) else e["metadata"])["kaizen_bootstrap"]
        for e in episodes
    }
    assert tags == {report["run_tag"]}
    asked = [
        json.loads(r["request"]) if isinstance(r["request"], str) else r["request"]
        for r in query(database_url, "SELECT request FROM calls")
    ]
    assert sorted(a["messages"][-1]["content"] for a in asked) == sorted(SCENARIOS * 2)
    # seeded: each attempt its own seed, scenario i's two attempts 100 + 2i and 101 + 2i; unseeded: none sent
    seeds = {(a["messages"][-1]["content"], a["params"].get("seed")) for a in asked}
    if seed is None:
        assert seeds == {(s, None) for s in SCENARIOS} and report["seed"] is None
    else:
        assert seeds == {(s, seed + 2 * i + j) for i, s in enumerate(SCENARIOS) for j in (0, 1)}
        assert report["seed"] == seed
    # the scripted upstream echoes the question: "echo: Name a color." has 19 characters, so 0.0 for all
    rewards = query(database_url, "SELECT source, value FROM rewards")
    assert [(r["source"], r["value"]) for r in rewards] == [("function", 0.0)] * 6


@pytest.mark.slow
def test_bootstrap_refuses_what_it_cannot_do(
    make_gateway: Callable[..., GatewayServer], tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'refusals.db'}"
    gw = make_gateway(url, admin_key=ADMIN_KEY)
    make_policy(url, "no-holdout", {"gate": {"holdout_fraction": 0.0}})
    common = [
        "--task=t",
        f"--gateway-url={gw.url}/v1",
        "--writer-model=m",
        "--writer-api-base=http://127.0.0.1:9/v1",
    ]
    without_key = kaizen("bootstrap", "--policy=no-holdout", *common, admin_key="")
    assert without_key.returncode == 2 and "KAIZEN_ADMIN_KEY" in without_key.stderr
    no_holdout = kaizen("bootstrap", "--policy=no-holdout", *common)
    assert no_holdout.returncode == 2 and "holdout_fraction" in no_holdout.stderr
    # every attempt's seed (24 scenarios, 4 attempts each, above the base) must stay in 64 bits
    for seed in ("-1", str(2**63 - 1)):
        bad_seed = kaizen("bootstrap", "--policy=no-holdout", f"--seed={seed}", *common)
        assert bad_seed.returncode == 2 and "--seed must be between 0 and" in bad_seed.stderr
    unknown = kaizen("bootstrap", "--policy=nope", *common)
    assert unknown.returncode == 1 and "no policy named 'nope'" in unknown.stderr
    assert query(url, "SELECT count(*) AS n FROM calls")[0]["n"] == 0


def test_group_keys_put_exactly_the_eval_scenarios_into_the_gates_held_out_share() -> None:
    keys = group_keys("bootstrap-ab12cd34", 12, 3, 0.1)
    assert [is_held_out(k, 0.1) for k in keys] == [True] * 3 + [False] * 9
    assert len(set(keys)) == 12


def test_auto_mode_uses_grpo_with_signal_and_a_warm_start_when_rewards_are_sparse() -> None:
    assert choose_mode("auto", [[0, 1], [1, 0], [0, 0]], 0.8) == "grpo"
    assert choose_mode("auto", [[0, 0], [0, 0], [1, 0]], 0.8) == "warm_start"
    assert choose_mode("auto", [[0.3, 0.3], [0.2, 0.5], [0.1, 0.1]], 0.8) == "grpo"
    assert choose_mode("auto", [[0, 0], [0.5, 0.5]], 0.8) is None
    assert choose_mode("sft", [[0, 0]], 0.8) == "sft"


@pytest.mark.slow
def test_bootstrap_from_an_mcp_servers_tools_attempts_whole_agent_episodes(
    make_gateway: Callable[..., GatewayServer], tmp_path: Path
) -> None:
    """MCP•RL's cold start: scenarios written from the tools of the policy's MCP server, each attempted as an agent
    episode whose tool calls go through `/mcp/<policy>` for real (recorded in the episode), then scored."""
    url = f"sqlite:///{tmp_path / 'mcp.db'}"
    gw = make_gateway(url, admin_key=ADMIN_KEY)
    server = {"name": "atlas", "command": [sys.executable, "-m", "tests.support.mcp_tools"], "timeout_s": 60}
    config = {
        "tools": {"servers": [server]},
        "rewards": {"scorer": {"function": "tests.support.reward_functions:length_score"}},
    }
    make_policy(url, "scripted-1", config)
    # `#tool`: the scripted engine calls one of the offered tools, then answers from its result.
    scenarios = ["Which capital is stored for zorland? #tool", "Look up the capital of vellmar. #tool"]
    with ScriptedJudge() as writer:
        writer.script.append(json.dumps({"scenarios": [{"message": m} for m in scenarios]}))
        done = kaizen(
            "bootstrap",
            "--policy=scripted-1",
            "--mcp=atlas",
            "--scenarios=2",
            "--attempts=2",
            "--no-train",
            f"--gateway-url={gw.url}/v1",
            "--writer-model=writer-model",
            f"--writer-api-base={writer.url}",
        )
        writer_prompt = writer.prompts()[0]
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert (report["scenarios"], report["episodes"], report["scored_episodes"]) == (2, 4, 4)
    # The writer was shown the server's tools, and asked for tasks that need them without naming them.
    assert "- lookup: Look up the capital stored under a country's key." in writer_prompt
    assert "must not name the tools" in writer_prompt
    episodes = query(url, "SELECT id FROM episodes WHERE source = 'bootstrap'")
    assert len(episodes) == 4
    calls = query(url, "SELECT episode_id, tool, source, is_error FROM tool_calls")
    assert {c["episode_id"] for c in calls} == {e["id"] for e in episodes}  # every attempt called a tool
    assert {(c["source"], bool(c["is_error"])) for c in calls} <= {("atlas", False), ("atlas", True)}
    # An attempt is a whole episode: the tool call, its result, and the answer made from it.
    for episode in episodes:
        rows = query(
            url,
            "SELECT request, response FROM calls WHERE episode_id = :e ORDER BY position",
            e=episode["id"],
        )
        assert len(rows) == 2
        last = (
            json.loads(rows[-1]["request"]) if isinstance(rows[-1]["request"], str) else rows[-1]["request"]
        )
        assert [m["role"] for m in last["messages"]] == ["user", "assistant", "tool"]


def test_bootstrap_refuses_a_server_the_policy_does_not_have(
    make_gateway: Callable[..., GatewayServer], tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'none.db'}"
    gw = make_gateway(url, admin_key=ADMIN_KEY)
    make_policy(url, "scripted-1", {"tools": {"functions": ["tests.support.tool_functions:capital"]}})
    done = kaizen(
        "bootstrap", "--policy=scripted-1", "--mcp=atlas", "--no-train", f"--gateway-url={gw.url}/v1",
        "--writer-model=w",
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert "has no tools from 'atlas' (its tools come from: function" in done.stderr
