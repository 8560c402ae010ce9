"""The dashboard's rollup stays exact, on SQLite and PostgreSQL: every write that lands in a bucket already
rolled up (a call replayed late, a reward derived again for an old episode, feedback linked late, retention)
marks it in its own transaction, and the next refresh makes the rollup equal to the raw rows again. Fresh
writes mark nothing, and one refresh runs at a time."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.settings import async_database_url
from storage.calls import write_calls
from storage.database import Database
from storage.locks import acquire_lock, release_lock
from storage.models import RollupMark
from storage.records import CallRecord
from storage.retention import prune_calls
from storage.rewards import NewReward, insert_rewards, link_pending
from storage.rollups import LOCK_KEY, Key, Sums, refresh_rollups, rolled_until, sum_rows, window_sums
from tests.support.synthetic_traffic import DAYS, POLICIES, load
from trainer.control.rewards import refresh_episode_rewards

STEP = 900


def _record(call_id: str, episode_id: str, at: float, policy: str = POLICIES[0]) -> CallRecord:
    return CallRecord(
        id=call_id,
        episode_id=episode_id,
        episode_resolved=True,
        policy=policy,
        model=policy,
        adapter_version=7,
        request={"messages": [{"role": "user", "content": "late"}]},
        response={"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]},
        usage={"prompt_tokens": 11, "completion_tokens": 13},
        latency_ms=321.0,
        created_at=at,
    )


def _key_figures(sums: dict[Key, Sums]) -> dict[Key, tuple[int, int, int, int, int, int, int, float]]:
    return {
        key: (
            s.calls,
            s.errors,
            s.prompt_tokens,
            s.completion_tokens,
            s.episodes,
            s.rewarded,
            s.feedback,
            round(s.reward_sum, 6),
        )
        for key, s in sums.items()
        if s.calls or s.episodes or s.feedback
    }


async def _marks(session: AsyncSession) -> int:
    return int(await session.scalar(select(func.count()).select_from(RollupMark)) or 0)


async def _assert_exact(database: Database) -> None:
    """Refresh, then the whole history read through the rollup equals the raw rows."""
    assert await refresh_rollups(database) is not None
    async with database.session() as session:
        reach = await rolled_until(session)
        assert reach is not None
        since = reach - timedelta(days=DAYS + 2)
        assert await _marks(session) == 0
        assert _key_figures(await window_sums(session, since, reach, STEP)) == _key_figures(
            await sum_rows(session, since, reach, STEP)
        )


def test_late_writes_marks_and_refreshes_keep_the_rollup_exact(database_url: str) -> None:
    url = async_database_url(database_url)
    asyncio.run(load(url, 400))

    async def run() -> None:
        database = Database(url)
        await _assert_exact(database)
        now = time.time()
        async with database.session() as session:
            # A call of now marks nothing: the capture path pays one comparison.
            assert await write_calls(session, [_record("c-fresh", "e-fresh", now)]) == 1
            assert await _marks(session) == 0
            # A call replayed three days late lands in a rolled-up bucket, and marks it.
            assert await write_calls(session, [_record("c-late", "e-late", now - 3 * 86400)]) == 1
            assert await _marks(session) == 1
        await _assert_exact(database)

        async with database.session() as session:
            # Feedback on an old episode: the episode's reward changes in its old bucket.
            await insert_rewards(session, [NewReward("feedback", 0.9, episode_id="e-late")])
            await refresh_episode_rewards(session, ["e-late"])
            await session.commit()
        await _assert_exact(database)

        async with database.session() as session:
            # Early feedback for a call not stored yet counts for no policy until it is linked.
            await insert_rewards(session, [NewReward("feedback", 1.0, call_id="c-early", status="pending")])
            await session.commit()
        await _assert_exact(database)
        async with database.session() as session:
            await write_calls(session, [_record("c-early", "e-early", now - 2 * 86400, POLICIES[1])])
            touched = await link_pending(session)
            await refresh_episode_rewards(session, touched)
            await session.commit()
        await _assert_exact(database)

        async with database.session() as session:
            # Retention deletes a policy's old calls, their episodes and rewards.
            calls, episodes = await prune_calls(
                session, POLICIES[2], datetime.now(UTC) - timedelta(days=DAYS / 2)
            )
            assert calls > 0 and episodes > 0
            await session.commit()
        await _assert_exact(database)
        await database.dispose()

    asyncio.run(run())


def test_one_refresh_at_a_time(database_url: str) -> None:
    url = async_database_url(database_url)
    asyncio.run(load(url, 100))

    async def run() -> None:
        database = Database(url)
        async with database.session() as session:
            assert await acquire_lock(session, LOCK_KEY, "another-replica", "rollups", 60)
        assert await refresh_rollups(database) is None  # busy: the page reads what is there
        async with database.session() as session:
            assert await rolled_until(session) is None
            await release_lock(session, LOCK_KEY, "another-replica")
        await _assert_exact(database)
        await database.dispose()

    asyncio.run(run())
