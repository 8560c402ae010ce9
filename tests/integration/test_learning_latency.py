"""When a version starts serving, the time from the rewards it was trained on to then, and rollouts: storage, the
dashboard's policy page and /metrics, on SQLite and PostgreSQL.

The seeded run of `bot` read the window (B, B + 3 h] at B + 3 h and produced version 1, which serves from
B + 6 h. Four of the window's rewards count, arrived at B + 20, 70, 150 and 165 min: 340, 290, 210 and
195 min before serving (median 250 min)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from sqlalchemy import delete

from gateway.settings import async_database_url
from migrations.runner import upgrade_database
from storage.database import Database
from storage.learning_latency import LatencyKey, LearningLatency, learning_latency
from storage.models import Call, Episode, Reward, Rollout, TrainingRun
from storage.policies import (
    activate_version,
    add_adapter,
    create_policy,
    get_adapter,
    get_policy,
    list_adapters,
    mark_serving,
)
from tests.integration.test_metrics import scrape, value
from tests.support.dashboard import login
from tests.support.gateway_server import GatewayServer

MakeGateway = Callable[..., GatewayServer]
ADMIN = {"authorization": "Bearer adm"}
B = datetime(2026, 11, 2, 8, 0, tzinfo=UTC)
MINUTE = timedelta(minutes=1)


async def _seed(database: Database) -> None:
    """`bot` with versions 0 (active first), 1 (trained on the window, serving from B + 6 h) and 2 (on canary);
    `other` with a version no run made."""
    async with database.session() as session:
        bot = await create_policy(session, "bot", "base")
        other = await create_policy(session, "other", "base")
        for version in range(3):
            await add_adapter(session, bot.id, version, f"/adapters/bot/{version}")
        await add_adapter(session, other.id, 0, "/adapters/other/0")
        await activate_version(session, bot.id, 0)
        await activate_version(session, other.id, 0)
        window = {"data_since": B.isoformat(), "data_until": (B + 180 * MINUTE).isoformat()}
        session.add(
            TrainingRun(
                policy_id=bot.id,
                kind="train",
                status="succeeded",
                from_version=0,
                to_version=1,
                config=window,
                started_at=B + 180 * MINUTE,
                finished_at=B + 240 * MINUTE,
            )
        )
        # (episode, policy, its rewards [(arrived, names the episode not its call, sender's project)], started),
        # in minutes from B
        episodes: list[tuple[str, str, list[tuple[int, bool, str | None]], int]] = [
            ("before", "bot", [(-50, True, None)], -60),  # started before the window
            ("e1", "bot", [(20, True, None)], 10),
            ("e2", "bot", [(70, False, None)], 60),  # names only its call
            ("e3", "bot", [(150, True, "default"), (300, True, None)], 120),  # 300: after the run read
            ("e4", "bot", [(165, True, None), (170, True, "elsewhere")], 160),  # another project's: never
            ("after", "bot", [(245, True, None)], 240),  # started after the window
            ("theirs", "other", [(30, True, None)], 20),  # another policy's
        ]
        for episode_id, policy, rewards, started in episodes:
            at = B + started * MINUTE
            session.add(Episode(id=episode_id, policy=policy, created_at=at, updated_at=at))
            await session.flush()  # before its call, which refers to it
            session.add(
                Call(
                    id=f"{episode_id}-call",
                    episode_id=episode_id,
                    position=0,
                    policy=policy,
                    model=policy,
                    adapter_version=0,
                    request={"messages": []},
                    latency_ms=1.0,
                    status="ok",
                    created_at=at,
                )
            )
            for arrived, on_episode, project in rewards:
                session.add(
                    Reward(
                        episode_id=episode_id if on_episode else None,
                        call_id=None if on_episode else f"{episode_id}-call",
                        source="feedback",
                        value=1.0,
                        project=project,
                        created_at=B + arrived * MINUTE,
                    )
                )
        await mark_serving(session, bot.id, 1, B + 360 * MINUTE)
        await activate_version(
            session, bot.id, 1
        )  # promoted after its canary: serving since the canary began
        session.add_all(
            [
                Rollout(
                    policy_id=bot.id,
                    mode="canary",
                    version=2,
                    baseline_version=1,
                    share=0.1,
                    status="running",
                    actor="scheduler",
                    stats={
                        "candidate": {"episodes": 40, "mean": 0.62},
                        "baseline": {"episodes": 300, "mean": 0.57},
                        "difference": {"estimate": 0.05, "low": -0.02, "high": None},
                        "decision": "continue",
                    },
                ),
                Rollout(
                    policy_id=bot.id,
                    mode="canary",
                    version=1,
                    share=0.1,
                    status="promoted",
                    actor="scheduler",
                ),
                Rollout(
                    policy_id=bot.id, mode="split", version=0, share=0.5, status="stopped", actor="admin"
                ),
                Rollout(
                    policy_id=other.id, mode="shadow", version=0, share=1.0, status="running", actor="admin"
                ),
            ]
        )
        await session.commit()


def seed(database_url: str) -> None:
    async def run() -> None:
        url = async_database_url(database_url)
        await upgrade_database(url)
        database = Database(url)
        try:
            await _seed(database)
        finally:
            await database.dispose()

    asyncio.run(run())


def test_a_version_serves_from_the_first_time_it_did(database_url: str) -> None:
    async def scenario() -> None:
        url = async_database_url(database_url)
        await upgrade_database(url)
        database = Database(url)
        try:
            async with database.session() as session:
                policy = await create_policy(session, "bot", "base")
                for version in range(3):
                    await add_adapter(session, policy.id, version, f"/adapters/bot/{version}")
                never = await get_adapter(session, policy.id, 0)
                assert never is not None and never.serving_since is None
                before = datetime.now(UTC)
                await activate_version(session, policy.id, 0)  # promotion: serving from now
                promoted = await get_adapter(session, policy.id, 0)
                assert promoted is not None
                first = promoted.serving_since
                assert first is not None and before <= first.replace(tzinfo=UTC) <= datetime.now(UTC)
                await mark_serving(session, policy.id, 1, B)  # a canary began
                await mark_serving(session, policy.id, 1, B + MINUTE)  # and another: the first time stays
                await activate_version(session, policy.id, 1)
                await activate_version(session, policy.id, 0)  # rolled back to
                await session.commit()
                since = {a.version: a.serving_since for a in await list_adapters(session, policy.id)}
                assert since[0] is not None and since[0].replace(tzinfo=UTC) == first.replace(tzinfo=UTC)
                assert since[1] is not None and since[1].replace(tzinfo=UTC) == B
                assert since[2] is None
        finally:
            await database.dispose()

    asyncio.run(scenario())


def test_the_latency_of_the_serving_version_counts_the_rewards_its_run_read(database_url: str) -> None:
    seed(database_url)

    async def read() -> None:
        database = Database(async_database_url(database_url))
        try:
            async with database.session() as session:
                (bot,) = await learning_latency(session)  # `other`'s version was made by no run
                assert (bot.policy, bot.version, bot.rewards) == ("bot", 1, 4)
                assert bot.serving_since == B + 360 * MINUTE
                assert (bot.newest_s, bot.median_s, bot.oldest_s) == (195 * 60, 250 * 60, 340 * 60)
                assert await learning_latency(session, "other") == []
                assert [row.version for row in await learning_latency(session, "bot")] == [1]
        finally:
            await database.dispose()

    asyncio.run(read())


def test_a_memo_computes_each_serving_versions_latency_once(database_url: str) -> None:
    seed(database_url)

    async def read() -> None:
        database = Database(async_database_url(database_url))
        try:
            async with database.session() as session:
                memo: dict[LatencyKey, LearningLatency | None] = {}
                (first,) = await learning_latency(session, memo=memo)
                assert list(memo.values()) == [first]
                await session.execute(delete(Reward).where(Reward.episode_id == "e1"))  # the oldest
                assert await learning_latency(session, memo=memo) == [first]  # not read again
                (fresh,) = await learning_latency(session)
                assert (fresh.rewards, fresh.oldest_s) == (3, 290 * 60)
                bot = await get_policy(session, "bot")
                assert bot is not None
                await activate_version(session, bot.id, 2)  # made by no run: no latency, and v1's is let go
                assert await learning_latency(session, memo=memo) == []
                assert memo == {}
        finally:
            await database.dispose()

    asyncio.run(read())


def test_metrics_report_reward_to_serving_and_rollouts(make_gateway: MakeGateway, database_url: str) -> None:
    seed(database_url)
    gw = make_gateway(database_url, admin_key="adm", metrics_db_interval_s=0.05)
    samples = scrape(gw, ADMIN)
    latency = "kaizen_reward_to_serving_seconds"
    assert value(samples, latency, policy="bot", version="1", reward="newest") == 195 * 60
    assert value(samples, latency, policy="bot", version="1", reward="median") == 250 * 60
    assert value(samples, latency, policy="bot", version="1", reward="oldest") == 340 * 60
    assert value(samples, "kaizen_reward_to_serving_rewards", policy="bot", version="1") == 4
    assert {dict(labels)["policy"] for name, labels in samples if name == latency} == {"bot"}

    assert value(samples, "kaizen_rollouts", policy="bot", status="running") == 1
    assert value(samples, "kaizen_rollouts", policy="bot", status="promoted") == 1
    assert value(samples, "kaizen_rollouts", policy="bot", status="stopped") == 1
    assert value(samples, "kaizen_rollouts", policy="other", status="running") == 1
    shares = {
        tuple(sorted(labels)): v for (name, labels), v in samples.items() if name == "kaizen_rollout_share"
    }
    assert shares == {  # running rollouts only
        (("mode", "canary"), ("policy", "bot"), ("version", "2")): 0.1,
        (("mode", "shadow"), ("policy", "other"), ("version", "0")): 1.0,
    }
    bounds = {
        dict(labels)["bound"]: v
        for (name, labels), v in samples.items()
        if name == "kaizen_rollout_difference" and dict(labels)["policy"] == "bot"
    }
    assert bounds == {"estimate": 0.05, "low": -0.02}  # no high: the evaluation left it undefined
    # The shadow has not been evaluated: no difference at all.
    assert not any(
        n == "kaizen_rollout_difference" and ("policy", "other") in labels for n, labels in samples
    )


def test_metrics_omit_the_rollout_share_when_none_runs(make_gateway: MakeGateway, database_url: str) -> None:
    asyncio.run(upgrade_database(async_database_url(database_url)))
    gw = make_gateway(database_url, admin_key="adm", metrics_db_interval_s=0.05)
    samples = scrape(gw, ADMIN)
    assert value(samples, "kaizen_metrics_database_ok") == 1
    assert not any(name.startswith(("kaizen_rollout", "kaizen_reward_to_serving")) for name, _ in samples)


def test_the_policy_page_shows_how_long_rewards_took_to_serve(
    make_gateway: MakeGateway, database_url: str
) -> None:
    seed(database_url)
    gw = make_gateway(database_url, admin_key="adm")
    client = login(gw.url, "adm")
    page = client.get("/dashboard/policies/bot")
    assert page.status_code == 200
    facts = re.search(r'<dl class="facts" id="reward-to-serving">(.*?)</dl>', page.text, re.S)
    assert facts is not None
    cells = {
        term: re.sub(r"<[^>]+>", "", detail).strip()
        for term, detail in re.findall(r"<dt>(.*?)</dt><dd[^>]*>(.*?)</dd>", facts.group(1), re.S)
    }
    assert cells == {
        "serving": "v1 since 2026-11-02 14:00:00, made by run 1 from 4 rewards",
        "newest reward": "3 h 15 min",
        "median": "4 h 10 min",
        "oldest reward": "5 h 40 min",
    }
    other = client.get("/dashboard/policies/other")
    assert other.status_code == 200
    assert re.search(r'<p class="muted" id="reward-to-serving">No figure', other.text)
