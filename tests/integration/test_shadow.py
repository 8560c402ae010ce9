"""Shadow rollouts: the candidate answers copies of a share of a policy's calls that nobody sees, the pairs are
stored (redacted as the calls are) but never as traffic, and the policy's scorer scores them for the monitor.

The engine is the scripted upstream attached as vLLM, so policy versions are routed and loaded as adapters."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.routing import trial_bucket
from gateway.settings import async_database_url
from migrations.runner import upgrade_database
from storage.database import Database
from storage.policies import activate_version, adapter_dir, add_adapter, create_policy
from storage.rollouts import RolloutInfo, end_rollout, get_rollout, start_rollout
from storage.shadows import NewPair, add_pairs, paired_differences, set_scores, unscored_pairs
from tests.conftest import query
from tests.integration.test_chat_capture import client
from tests.support.gateway_server import GatewayServer
from tests.support.polling import wait_until
from tests.support.scripted_judge import default_answer
from tests.support.scripted_upstream import ScriptedUpstream
from tests.support.sql import in_session
from trainer.control.policy_config import RewardConfig
from trainer.control.ruler import Completion, JudgeSettings
from trainer.control.scoring import Scorer
from trainer.control.shadow_scoring import score_shadow_pairs

MakeGateway = Callable[..., GatewayServer]


def shadowed_policy(
    url: str, data_dir: Path, share: float, config: dict[str, Any] | None = None
) -> tuple[str, int]:
    """A policy serving version 0 with version 1 in a shadow rollout of `share`: (its name, the rollout's id)."""
    name = f"shadow-{uuid.uuid4().hex[:8]}"  # the upstream is shared: its adapters' names must not clash

    async def register(session: Any) -> int:
        policy = await create_policy(
            session, name, "scripted-1", {"schedule": {"paused": True}, **(config or {})}
        )
        for version in (0, 1):
            path = adapter_dir(data_dir, name, version)
            path.mkdir(parents=True)
            await add_adapter(session, policy.id, version, str(path))
        await activate_version(session, policy.id, 0)
        await session.flush()
        rollout = await start_rollout(session, name, 1, mode="shadow", share=share, actor="test")
        return rollout.id

    return name, in_session(url, register)


def shadow_gateway(
    make_gateway: MakeGateway, upstream: ScriptedUpstream, url: str, **overrides: Any
) -> GatewayServer:
    return make_gateway(
        url, engine="vllm", vllm_url=upstream.url, base_model="scripted-1", policy_refresh_s=0.1, **overrides
    )


def trial_seen(gw: GatewayServer, policy: str) -> None:
    wait_until(
        lambda: (state := gw.services.router.policies.get(policy)) is not None and state.trial is not None,
        "the gateway to see the shadow rollout",
    )


def count(url: str, table: str) -> int:
    return int(query(url, f"SELECT count(*) AS n FROM {table}")[0]["n"])


def pairs(url: str) -> list[dict[str, Any]]:
    rows = query(url, "SELECT * FROM shadow_pairs ORDER BY id")
    for row in rows:  # JSON columns come back as text from SQLite
        for key in ("messages", "served", "shadow"):
            if isinstance(row[key], str):
                row[key] = json.loads(row[key])
    return rows


def test_each_answered_call_gets_a_pair_and_no_traffic_is_added(
    make_gateway: MakeGateway, upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'shadow.db'}"
    gw = shadow_gateway(make_gateway, upstream, url)
    policy, rollout_id = shadowed_policy(url, gw.settings.data_dir, 1.0)
    trial_seen(gw, policy)
    openai_client = client(gw)
    sent = []
    for index in range(2):
        messages = [{"role": "user", "content": f"question {index}"}]
        raw = openai_client.chat.completions.with_raw_response.create(
            model=policy,
            messages=messages,
            temperature=0.3,
            n=2,  # type: ignore[arg-type]
        )
        assert raw.headers["x-kaizen-model"] == f"{policy}@0"
        assert raw.parse().choices[0].message.content == f"echo: question {index} [0]"  # choice 0 of 2
        sent.append((raw.headers["x-request-id"], messages))
    streamed = [{"role": "user", "content": "streamed question"}]
    text = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in openai_client.chat.completions.create(model=policy, messages=streamed, stream=True)  # type: ignore[arg-type]
        if chunk.choices
    )
    assert text == "echo: streamed question"
    # Pinned versions and plain models are not shadowed; neither is a call the app asked not to log.
    openai_client.chat.completions.create(
        model=f"{policy}@0", messages=[{"role": "user", "content": "pinned"}]
    )
    openai_client.chat.completions.create(
        model=policy,
        messages=[{"role": "user", "content": "unlogged"}],
        extra_headers={"X-Kaizen-No-Log": "true"},
    )

    wait_until(lambda: count(url, "shadow_pairs") == 3, "three shadow pairs")
    gw.flush()
    # Five calls were answered; the copies added no call and no episode.
    assert count(url, "calls") == 4
    assert count(url, "episodes") == 4
    assert {r["adapter_version"] for r in query(url, "SELECT adapter_version FROM calls")} == {0}
    stored = pairs(url)
    assert [row["rollout_id"] for row in stored] == [rollout_id] * 3
    by_call = {row["call_id"]: row for row in stored}
    for call_id, messages in sent:
        row = by_call[call_id]
        assert row["messages"] == messages
        # The app's first choice, and the candidate's one answer.
        assert row["served"]["content"] == "echo: " + messages[0]["content"] + " [0]"
        assert row["shadow"]["content"] == "echo: " + messages[0]["content"]
        assert row["served_reward"] is None and row["scored_at"] is None
    # The candidate was asked once per copy, for one non-streamed answer with the client's sampling parameters.
    copies = [r.body for r in upstream.requests if r.body.get("model") == f"{policy}@1"]
    assert len(copies) == 3
    assert all(body["n"] == 1 and not body.get("stream") and "stream_options" not in body for body in copies)
    assert [body.get("temperature") for body in copies if body["messages"] != streamed] == [0.3, 0.3]
    tap = gw.services.shadow
    assert tap is not None
    wait_until(lambda: tap.counts == {"copied": 3, "stored": 3}, "the tap to count the stored pairs")


def test_a_share_copies_the_calls_whose_sticky_key_falls_in_it(
    make_gateway: MakeGateway, upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'share.db'}"
    gw = shadow_gateway(make_gateway, upstream, url)
    policy, rollout_id = shadowed_policy(url, gw.settings.data_dir, 0.5)
    trial_seen(gw, policy)
    users = [f"user-{i}" for i in range(40)]
    expected = {user for user in users if trial_bucket(rollout_id, user) < 0.5}
    assert 10 <= len(expected) <= 30  # roughly half, and both sides tested
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        for user in users:
            for turn in range(2):  # a user's calls all stay on one side
                response = http.post(
                    "/v1/chat/completions",
                    json={
                        "model": policy,
                        "user": user,
                        "messages": [{"role": "user", "content": f"t{turn}"}],
                    },
                )
                assert response.status_code == 200, response.text
    wait_until(lambda: count(url, "shadow_pairs") == 2 * len(expected), "a pair per call in the share")
    gw.flush()
    copied = query(url, "SELECT DISTINCT c.user AS user FROM shadow_pairs p JOIN calls c ON c.id = p.call_id")
    assert {row["user"] for row in copied} == expected
    assert count(url, "calls") == 80


def test_a_full_queue_drops_and_counts_without_delaying_calls(
    make_gateway: MakeGateway, upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'full.db'}"
    gw = shadow_gateway(make_gateway, upstream, url, shadow_queue=2)
    policy, _ = shadowed_policy(url, gw.settings.data_dir, 1.0)
    trial_seen(gw, policy)
    tap = gw.services.shadow
    assert tap is not None
    gw.call(tap.stop())  # nothing takes copies off the queue any more
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        for index in range(5):
            response = http.post(
                "/v1/chat/completions",
                json={"model": policy, "messages": [{"role": "user", "content": f"q{index}"}]},
            )
            assert response.status_code == 200, response.text
    assert tap.counts == {"copied": 2, "dropped": 3}
    scrape = httpx.get(gw.url + "/metrics", timeout=10).text
    assert 'kaizen_shadow_calls_total{status="dropped"} 3.0' in scrape
    gw.flush()
    assert count(url, "calls") == 5
    assert count(url, "shadow_pairs") == 0


def test_a_copy_waiting_when_its_rollout_ends_is_not_answered(
    make_gateway: MakeGateway, upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'ended.db'}"
    gw = shadow_gateway(make_gateway, upstream, url)
    policy, rollout_id = shadowed_policy(url, gw.settings.data_dir, 1.0)
    trial_seen(gw, policy)
    tap = gw.services.shadow
    assert tap is not None
    gw.call(tap.stop())
    client(gw).chat.completions.create(model=policy, messages=[{"role": "user", "content": "late"}])
    assert tap.counts == {"copied": 1}
    in_session(url, lambda session: end_rollout(session, rollout_id, "stopped", reason="test", actor="test"))
    wait_until(
        lambda: gw.services.router.policies[policy].trial is None, "the gateway to see the rollout end"
    )
    gw.call(tap.start())
    wait_until(lambda: tap.counts == {"copied": 1, "stale": 1}, "the copy to be given up")
    assert not [r for r in upstream.requests if r.body.get("model") == f"{policy}@1"]
    assert count(url, "shadow_pairs") == 0


def test_pairs_are_redacted_as_the_policys_calls_are(
    make_gateway: MakeGateway, upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'private.db'}"
    gw = shadow_gateway(make_gateway, upstream, url)
    policy, _ = shadowed_policy(url, gw.settings.data_dir, 1.0, {"privacy": {"mode": "mask"}})
    trial_seen(gw, policy)
    wait_until(lambda: gw.services.router.redactor(policy) is not None, "the policy's redactor")
    reply = client(gw).chat.completions.create(
        model=policy, messages=[{"role": "user", "content": "mail jane.roe@example.org"}]
    )
    assert reply.choices[0].message.content == "echo: mail jane.roe@example.org"  # the app gets it as it was
    wait_until(lambda: count(url, "shadow_pairs") == 1, "the shadow pair")
    [row] = pairs(url)
    assert row["messages"] == [{"role": "user", "content": "mail [EMAIL]"}]
    assert row["served"]["content"] == row["shadow"]["content"] == "echo: mail [EMAIL]"
    assert "jane.roe" not in json.dumps(row)


# ----------------------------------------------------------------------------- scoring and the decision's numbers
def stored_pairs(url: str, data_dir: Path, replies: list[tuple[str, str]]) -> RolloutInfo:
    """A shadow rollout with a pair per (served, shadow) reply, as a gateway would have stored them."""
    _, rollout_id = shadowed_policy(url, data_dir, 1.0)

    async def add(session: Any) -> RolloutInfo:
        await add_pairs(
            session,
            [
                NewPair(
                    rollout_id,
                    f"call-{index}",
                    [{"role": "user", "content": f"question {index}"}],
                    {"role": "assistant", "content": served},
                    {"role": "assistant", "content": shadow},
                    datetime.now(UTC),
                )
                for index, (served, shadow) in enumerate(replies)
            ],
        )
        rollout = await get_rollout(session, rollout_id)
        assert rollout is not None
        return rollout

    rollout: RolloutInfo = in_session(url, add)
    return rollout


def differences(url: str, rollout_id: int) -> tuple[int, float, float]:
    found: tuple[int, float, float] = in_session(url, lambda session: paired_differences(session, rollout_id))
    return found


def score(url: str, rollout: RolloutInfo, scorer: Scorer) -> int:
    async def run() -> int:
        database = Database(async_database_url(url))
        try:
            return await score_shadow_pairs(database, rollout, scorer)
        finally:
            await database.dispose()

    return asyncio.run(run())


def test_a_reward_function_scores_both_replies_and_the_differences_add_up(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'scores.db'}"
    asyncio.run(upgrade_database(async_database_url(url)))
    # Rewards are the replies' lengths: differences 2, -2 and 5; "boom" makes the function raise.
    rollout = stored_pairs(url, tmp_path, [("ab", "abcd"), ("abc", "a"), ("boom", "x"), ("a", "abcdef")])
    config = RewardConfig.model_validate(
        {"scorer": {"function": "tests.support.reward_functions:reply_length"}}
    )
    scorer = Scorer(config, JudgeSettings(model=""))
    assert differences(url, rollout.id) == (0, 0.0, 0.0)
    assert score(url, rollout, scorer) == 3
    rows = pairs(url)
    assert [(r["served_reward"], r["shadow_reward"]) for r in rows] == [
        (2.0, 4.0),
        (3.0, 1.0),
        (None, None),  # the scorer failed: marked, not tried again, left out of the comparison
        (1.0, 6.0),
    ]
    assert all(r["scored_at"] is not None for r in rows)
    assert score(url, rollout, scorer) == 0
    n, mean, variance = differences(url, rollout.id)
    # By hand: mean (2 - 2 + 5) / 3 = 5/3; variance ((1/3)^2 + (11/3)^2 + (10/3)^2) / 2 = 37/3.
    assert n == 3
    assert mean == pytest.approx(5 / 3)
    assert variance == pytest.approx(37 / 3)


def test_one_scored_pair_has_no_variance(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'one.db'}"
    asyncio.run(upgrade_database(async_database_url(url)))
    rollout = stored_pairs(url, tmp_path, [("a", "b"), ("c", "d")])

    async def score_one(session: Any) -> None:
        [first, _] = await unscored_pairs(session, rollout.id, 10)
        await set_scores(session, [(first.id, 0.25, 1.0)])

    in_session(url, score_one)
    assert differences(url, rollout.id) == (1, 0.75, 0.0)


def test_the_judge_sees_both_replies_side_by_side_in_alternating_order(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'judge.db'}"
    asyncio.run(upgrade_database(async_database_url(url)))
    rollout = stored_pairs(
        url, tmp_path, [("a good reply", "a poor reply"), ("a poor reply", "a good reply")]
    )
    prompts: list[str] = []

    async def judge(messages: list[dict[str, Any]], _: dict[str, Any], __: JudgeSettings) -> Completion:
        prompts.append(messages[-1]["content"])
        return Completion(default_answer(messages[-1]["content"]), None, 1.0)

    scorer = Scorer(RewardConfig(), JudgeSettings(model="judge", backoff_s=0.0), complete=judge)
    assert score(url, rollout, scorer) == 2
    assert [(r["served_reward"], r["shadow_reward"]) for r in pairs(url)] == [(0.9, 0.1), (0.1, 0.9)]
    assert len(prompts) == 2  # one judgement per pair
    for prompt in prompts:
        assert prompt.count("question") == 1  # the shared context once, then both replies
        assert prompt.count("<trajectory id=") == 2
    # The first reply the judge reads is the good one in both pairs: served first once, the candidate's once.
    assert all(p.index("good") < p.index("poor") for p in prompts)
