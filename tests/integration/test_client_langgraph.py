"""The LangGraph example of docs/client.md, run as documented against a real gateway: a tool-using agent's
rollouts are captured as episodes, judged with RULER through the admin API, trained on by the real trainer,
and the new version is promoted and waited for.

Two stand-ins, as the page says: the embedded 135M model cannot choose tools reliably, so the agent's turns are
answered by the scripted upstream (`#agent 2`: two tool calls, then an answer from the tool results), and
RULER's answers come from the scripted judge, so each group's scores are known exactly. And a third: the example's
weather tool draws one of two texts at random, so with a scripted agent all four attempts at a question would be
the same conversation about once in 64 groups, and training rightly drops a group whose members share every
token; the test gives every reading a number of its own, so the attempts always differ.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from gateway.settings import async_database_url
from storage.database import Database
from storage.policies import create_policy
from tests.conftest import query
from tests.support.gateway_server import GatewayServer
from tests.support.scripted_judge import ScriptedJudge
from tests.support.training_data import NO_COLLAPSE_BOUNDS

# Trains on every core: `make test` runs it on its own, never beside another test (README, "Test").
pytestmark = pytest.mark.serial

DOCS = Path(__file__).resolve().parents[2] / "docs" / "client.md"
API_KEY = "sk-agent"
ADMIN_KEY = "sk-admin"
POLICY = "scripted-1"  # a model the scripted upstream serves: the calls are stored under this policy
QUESTIONS = ["Is today a good day for a walk in Paris or in London?", "What should I pack for Oslo tomorrow?"]
SCORES = [0.9, 0.2, 0.6, 0.1]  # RULER's answer for every group of four attempts
TRAIN = {
    "epochs": 1,
    "micro_batch_size": 4,
    "grad_accumulation": 1,
    "collapse_check_every": 0,
    "collapse_prompts": 1,
    "collapse_samples": 2,
    "collapse_max_new_tokens": 8,
    "collapse_bounds": NO_COLLAPSE_BOUNDS,
}


def documented_example() -> dict[str, Any]:
    """The code block of docs/client.md marked `example: langgraph`, executed as a module (not as __main__)."""
    page = DOCS.read_text()
    block = re.search(r"<!-- example: langgraph -->\n```python\n(.*?)```", page, re.S)
    assert block is not None, "docs/client.md lost its LangGraph example"
    namespace: dict[str, Any] = {"__name__": "docs_client_example"}
    exec(compile(block.group(1), str(DOCS), "exec"), namespace)
    return namespace


class NumberedReadings:
    """Stands in for the example's `random`: the tool's text, alternating, with a reading number of its own."""

    def __init__(self) -> None:
        self._count = itertools.count(1)

    def choice(self, options: Sequence[str]) -> str:
        n = next(self._count)
        return f"{options[n % len(options)]} (reading {n})"


def ruler_answer(scores: list[float]) -> str:
    entries = [
        {"trajectory_id": f"t{i}", "explanation": f"attempt {i}", "score": score}
        for i, score in enumerate(scores, start=1)
    ]
    return json.dumps({"scores": entries})


def test_the_documented_langgraph_agent_is_captured_judged_trained_and_promoted(
    make_gateway: Callable[..., GatewayServer], tmp_path: Path, embedded_model: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'agent.db'}"
    with ScriptedJudge() as judge:
        gw = make_gateway(
            url,
            api_keys=[API_KEY],
            admin_key=ADMIN_KEY,
            judge_model="judge-model",
            judge_api_base=judge.url,
            policy_refresh_s=0.5,
            # as in production capture-only mode: the upstream's ids are not the policy's tokenizer's
            upstream_token_ids=False,
        )

        async def setup() -> None:
            database = Database(async_database_url(url))
            try:
                async with database.session() as session:
                    # No version yet: capture-only serving (the scripted upstream) cannot serve adapters, so the
                    # gate has nothing to compare with and promotes the first candidate.
                    config = {"train": TRAIN, "gate": {"holdout_fraction": 0.0}}
                    await create_policy(session, POLICY, str(embedded_model), config)
                    await session.commit()
            finally:
                await database.dispose()

        asyncio.run(setup())
        judge.script.extend(ruler_answer(SCORES) for _ in QUESTIONS)
        example = documented_example()
        example["random"] = NumberedReadings()  # the tool looks `random` up in the example's globals
        model = example["Model"](POLICY, gw.url, api_key=API_KEY, admin_key=ADMIN_KEY, poll_s=0.2)
        run = asyncio.run(example["main"](model, [f"{q} #agent 2" for q in QUESTIONS]))
        judged_prompts = judge.prompts()

    # Captured: one episode per attempt, its three turns stitched by X-Episode-Id, grouped per question.
    episodes = query(url, "SELECT id, group_key, source FROM episodes WHERE policy = :p", p=POLICY)
    assert len(episodes) == 4 * len(QUESTIONS)
    assert len({e["group_key"] for e in episodes}) == len(QUESTIONS) and {e["source"] for e in episodes} == {
        "traffic"
    }
    turns = query(url, "SELECT episode_id, count(*) AS n FROM calls GROUP BY episode_id")
    assert sorted(t["n"] for t in turns) == [3] * len(episodes)
    last = query(url, "SELECT request, response FROM calls WHERE position = 2 LIMIT 1")[0]
    request = json.loads(last["request"]) if isinstance(last["request"], str) else last["request"]
    assert [m["role"] for m in request["messages"]] == ["user", "assistant", "tool", "assistant", "tool"]
    assert request["tools"][0]["function"]["name"] == "get_weather"
    assert all("(reading " in m["content"] for m in request["messages"] if m["role"] == "tool")

    # Judged with RULER, group by group (4 attempts each), the tool calls and their results in view. The training
    # run's collapse checks ask the judge too, about their 2 fresh replies beside the captured one (3 in all).
    group_prompts = [p for p in judged_prompts if p.count('<trajectory id="t') == 4]
    assert len(group_prompts) == len(QUESTIONS) and all("(tool result)" in p for p in group_prompts)
    assert all(p.count('<trajectory id="t') == 3 for p in judged_prompts if p not in group_prompts)
    rewards = query(url, "SELECT value FROM rewards WHERE source = 'judge'")
    assert sorted(r["value"] for r in rewards) == sorted(SCORES * len(QUESTIONS))

    # Trained on the real trainer from the captured conversations, gated, promoted and waited for.
    assert run.kind == "train" and run.status == "succeeded", run.error
    assert run.promoted and run.to_version == 0
    assert run.metrics["groups"] == len(QUESTIONS) and run.metrics["samples"] == 4 * len(QUESTIONS)
    # Every turn of every episode is trained (three calls each), and capture-only traffic has no token ids.
    assert run.metrics["data"]["retokenised"] == 3 * 4 * len(QUESTIONS)
    assert asyncio.run(model.version()) == 0
    assert Path(query(url, "SELECT path FROM adapters")[0]["path"], "adapter_config.json").is_file()
