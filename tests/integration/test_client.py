"""The Python client against a real gateway (scripted upstream): trajectories become episodes in their groups,
`gather` runs attempts concurrently and keeps failures apart, rewards set in code arrive once as signed feedback,
and refusals are `KaizenError`s. It imports nothing of the server side or the training stack."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Callable

import pytest

from gateway.client import KaizenError, Model, RolloutsFailed, Trajectory, gather
from tests.conftest import query
from tests.support.gateway_server import GatewayServer

API_KEY = "sk-rollouts"
ADMIN_KEY = "sk-admin"
SECRET = "whsec-rollouts"


def test_importing_the_client_loads_no_server_and_no_training_stack() -> None:
    probe = (
        "import sys, gateway.client\n"
        "heavy = ('torch', 'polars', 'litestar', 'sqlalchemy', 'openai', 'trainer', 'storage', 'litellm')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


async def rollout(trajectory: Trajectory, scenario: str) -> float:
    if scenario == "boom":
        raise RuntimeError("the environment crashed")
    client = trajectory.async_openai_client()
    async with client:
        for turn in ("first", "second"):  # two calls, one episode
            await client.chat.completions.create(
                model="scripted-1", messages=[{"role": "user", "content": f"{scenario} {turn}"}]
            )
    trajectory.metrics["turns"] = 2
    return float(len(scenario))


def test_gather_send_rewards_and_refusals(
    make_gateway: Callable[..., GatewayServer], database_url: str
) -> None:
    gw = make_gateway(database_url, api_keys=[API_KEY], admin_key=ADMIN_KEY, feedback_secret=SECRET)
    model = Model("scripted-1", gw.url + "/v1", api_key=API_KEY, admin_key=ADMIN_KEY, feedback_secret=SECRET)
    model.poll_s = 0.05

    async def scenario() -> None:
        with pytest.raises(RolloutsFailed, match="2 of 6 rollouts failed") as failed:
            await gather(model, rollout, ["a", "boom", "ccc"], attempts=2, concurrency=3, progress=False)
        groups = await gather(
            model,
            rollout,
            ["a", "boom", "ccc"],
            attempts=2,
            group_keys=["g-a", "g-boom", "g-ccc"],
            max_failures=2,
            progress=False,
        )
        assert [(g.key, len(g.trajectories), len(g.failures)) for g in groups] == [
            ("g-a", 2, 0),
            ("g-boom", 0, 2),
            ("g-ccc", 2, 0),
        ]
        assert all(isinstance(t.error, RuntimeError) for t in groups[1].failures)
        assert [g.rewards for g in failed.value.groups] == [[1.0, 1.0], [], [3.0, 3.0]]
        await model.wait_until_stored(groups)
        assert await model.send_rewards(groups) == 4
        assert await model.send_rewards(groups) == 0  # idempotent: a retry stores nothing twice
        episode = await model.episode(groups[2].trajectories[0].episode_id)
        assert episode["reward"] == 3.0 and episode["group_key"] == "g-ccc"
        assert [r["name"] for r in episode["rewards"]] == ["rollout"]
        assert episode["rewards"][0]["metadata"] == {"turns": 2}

        with pytest.raises(KaizenError) as refused:
            await Model("nope", gw.url, admin_key=ADMIN_KEY).train()
        assert (refused.value.status, refused.value.code) == (404, "policy_not_found")
        with pytest.raises(KaizenError) as unauthorised:
            await Model("scripted-1", gw.url, admin_key="wrong").info()
        assert unauthorised.value.status == 401

    asyncio.run(scenario())
    # Each trajectory is one episode of two calls in its group; the two gathers made eight such episodes.
    rows = query(database_url, "SELECT episode_id, count(*) AS n FROM calls GROUP BY episode_id")
    assert sorted(r["n"] for r in rows) == [2] * 8
    keyed = query(
        database_url, "SELECT group_key FROM episodes WHERE group_key LIKE 'g-%' ORDER BY group_key"
    )
    assert [r["group_key"] for r in keyed] == ["g-a", "g-a", "g-ccc", "g-ccc"]
    feedback = query(database_url, "SELECT value, metadata FROM rewards ORDER BY value")
    assert [r["value"] for r in feedback] == [1.0, 1.0, 3.0, 3.0]
    metadata = [json.loads(m) if isinstance(m, str) else m for m in (r["metadata"] for r in feedback)]
    assert metadata == [{"turns": 2}] * 4
