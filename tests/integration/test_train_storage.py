"""The trainer's SQL on SQLite and PostgreSQL: rewarded-episode selection and training runs."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

from gateway.settings import async_database_url
from migrations.runner import upgrade_database
from storage.calls import write_calls
from storage.database import Database
from storage.models import Episode, Reward
from storage.policies import create_policy
from storage.records import CallRecord
from storage.training import (
    episode_calls,
    finish_run,
    last_data_cutoff,
    rewarded_episodes,
    start_run,
    unrewarded_episodes,
)


def record(call_id: str, episode_id: str, created_at: float) -> CallRecord:
    return CallRecord(
        id=call_id,
        episode_id=episode_id,
        episode_resolved=True,
        policy="p",
        model="p",
        request={"messages": [{"role": "user", "content": "hi"}]},
        response={"choices": [{"message": {"role": "assistant", "content": "yo"}}]},
        prompt_token_ids=[1, 2],
        completion_token_ids=[[3, 2]],
        completion_logprobs=[[-0.5, -0.1]],
        created_at=created_at,
    )


def test_selection_window_rewards_and_lock(database_url: str) -> None:
    url = async_database_url(database_url)

    async def scenario() -> None:
        await upgrade_database(url)
        db = Database(url)
        try:
            now = time.time()
            async with db.session() as session:
                policy = await create_policy(session, "p", "base")
                await session.commit()
                await write_calls(
                    session,
                    [
                        record("c1", "e1", now - 30),
                        record("c2", "e2", now - 20),
                        record("c3", "e3", now - 10),
                    ],
                )
                session.add_all(
                    [
                        Reward(call_id="c1", source="feedback", value=1.0),
                        Reward(episode_id="e1", source="judge", value=0.0),
                        Reward(call_id="c3", source="rule", value=0.25),
                    ]
                )
                await session.commit()
                e3 = await session.get(Episode, "e3")
                assert e3 is not None
                e3.reward = 0.75  # the derived episode reward wins over the raw rows
                await session.commit()

                until = datetime.now(UTC)
                rows = await rewarded_episodes(session, "p", since=None, until=until)
                assert [(r.id, r.reward, r.reward_count) for r in rows] == [("e1", 0.5, 2), ("e3", 0.75, 1)]
                later = await rewarded_episodes(session, "p", since=rows[0].created_at, until=until)
                assert [r.id for r in later] == ["e3"]
                calls = await episode_calls(session, ["e1", "e3"])
                assert calls["e1"][0].completion_token_ids == [[3, 2]]

                assert await last_data_cutoff(session, policy.id) is None
                run = await start_run(session, policy.id, None, {})
                await finish_run(
                    session,
                    run,
                    status="succeeded",
                    metrics={},
                    config_update={"data_until": until.isoformat()},
                )
                await session.commit()
                assert await last_data_cutoff(session, policy.id) == until
        finally:
            await db.dispose()

    asyncio.run(scenario())


def test_unrewarded_episodes_of_demonstration_sources(database_url: str) -> None:
    """Demonstrations without a reward: only the sources asked for, only episodes no reward names (neither
    themselves nor one of their calls), only inside the window."""
    url = async_database_url(database_url)

    async def scenario() -> list[str]:
        await upgrade_database(url)
        db = Database(url)
        try:
            now = time.time()
            records = [
                record("c1", "imported", now - 30),
                record("c2", "imported-rewarded", now - 20),
                record("c3", "imported-call-rewarded", now - 20),
                record("c4", "bootstrapped", now - 10),
                record("c5", "traffic", now - 10),
                record("c6", "imported-old", now - 3600),
            ]
            for r in records:
                r.source = {"bootstrapped": "bootstrap", "traffic": "traffic"}.get(r.episode_id, "import")
            async with db.session() as session:
                await create_policy(session, "p", "base")
                await write_calls(session, records)
                session.add_all(
                    [
                        Reward(episode_id="imported-rewarded", source="feedback", value=1.0),
                        Reward(call_id="c3", source="feedback", value=0.0),
                    ]
                )
                await session.commit()
                since = datetime.fromtimestamp(now - 600, UTC)
                found = await unrewarded_episodes(
                    session, "p", sources=["import", "bootstrap"], since=since, until=datetime.now(UTC)
                )
            assert all(e.reward == 0.0 and e.reward_count == 0 for e in found)
            return [e.id for e in found]
        finally:
            await db.dispose()

    assert asyncio.run(scenario()) == ["imported", "bootstrapped"]
