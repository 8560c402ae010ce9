"""The one job lock on SQLite and PostgreSQL: exclusive per policy, taken over once expired, exclusive under
concurrent attempts, and handed down to the scheduler's training child."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sqlalchemy import select

from gateway.settings import async_database_url
from migrations.runner import upgrade_database
from storage.database import Database
from storage.locks import acquire_lock, lock_owner, release_lock, renew_lock
from storage.models import JobLock
from storage.policies import create_policy
from tests.support.polling import wait_until_async
from trainer.learner.job import TrainingBusy, TrainRequest, run_training


async def fresh_database(url: str) -> Database:
    url = async_database_url(url)
    await upgrade_database(url)
    return Database(url)


def test_job_lock_is_exclusive_and_expires(database_url: str) -> None:
    async def scenario() -> None:
        database = await fresh_database(database_url)
        try:
            async with database.session() as session:
                assert await acquire_lock(session, "p", "a", "judge", ttl_s=60)
                assert not await acquire_lock(session, "p", "b", "train", ttl_s=60)
                assert await acquire_lock(session, "q", "b", "train", ttl_s=60)  # other policies are free
                assert not await renew_lock(session, "p", "b", ttl_s=60)
                await release_lock(session, "p", "a")
                assert await acquire_lock(session, "p", "b", "train", ttl_s=0.2)
                # b stops renewing (crashed): once its lock expires, c takes it over.
                await wait_until_async(
                    lambda: acquire_lock(session, "p", "c", "judge", ttl_s=60), "b's lock to expire"
                )
                assert not await renew_lock(session, "p", "b", ttl_s=60)
                assert await renew_lock(session, "p", "c", ttl_s=60)
        finally:
            await database.dispose()

    asyncio.run(scenario())


def test_job_lock_is_exclusive_under_concurrency(database_url: str) -> None:
    async def scenario() -> list[bool]:
        database = await fresh_database(database_url)
        try:

            async def attempt() -> bool:
                async with database.session() as session:
                    return await acquire_lock(session, "p", lock_owner(), "train", ttl_s=60)

            return list(await asyncio.gather(*(attempt() for _ in range(5))))
        finally:
            await database.dispose()

    assert sorted(asyncio.run(scenario())) == [False, False, False, False, True]


def test_training_child_runs_under_its_parents_lock(tmp_path: Path) -> None:
    """A run started with the parent's owner trains under that lock and leaves releasing it to the parent;
    an owner that holds nothing is refused."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'kaizen.db'}"

    async def scenario() -> None:
        database = await fresh_database(url)
        try:
            async with database.session() as session:
                await create_policy(session, "p", "base", {"train": {"grouping": "key"}})
                await session.commit()
                assert await acquire_lock(session, "p", "parent", "train", ttl_s=60)
            with pytest.raises(TrainingBusy):
                await run_training(database, TrainRequest("p", tmp_path, "unused", lock_owner="someone-else"))
            outcome = await run_training(database, TrainRequest("p", tmp_path, "unused", lock_owner="parent"))
            assert outcome.status == "skipped"  # no rewarded episodes: it ran, and found nothing to train on
            async with database.session() as session:
                assert await session.scalar(select(JobLock.owner).where(JobLock.key == "p")) == "parent"
        finally:
            await database.dispose()

    asyncio.run(scenario())
