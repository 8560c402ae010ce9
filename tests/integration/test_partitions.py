"""`calls` partitioned by day on PostgreSQL (revision 0015): the migration carries stored calls, other revisions'
indexes and views over (and back on downgrade), writes stay idempotent by call id, a call beyond the prepared days
waits in the default partition until its day is created, and retention drops a whole day only when every call in
it is past its own owner's retention."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from alembic import command
from sqlalchemy import text

from gateway.settings import async_database_url
from migrations.runner import alembic_config, upgrade_database
from storage.calls import write_calls
from storage.database import Database
from storage.models import Reward
from storage.partitions import ensure_partitions, list_partitions, partition_name
from storage.policies import create_policy
from storage.records import CallRecord
from tests.integration.test_scheduler import runner
from tests.support.postgres import PostgresServer
from tests.support.sql import fetch_rows

TODAY = datetime.now(UTC).date()


def at(days_ago: float) -> float:
    """A time `days_ago` days before now (noon of that day, so it is well inside its partition)."""
    day = TODAY - timedelta(days=int(days_ago))
    return datetime(day.year, day.month, day.day, 12, tzinfo=UTC).timestamp()


def call(policy: str | None, created_at: float, episode: str | None = None) -> CallRecord:
    call_id = uuid.uuid4().hex
    return CallRecord(
        id=call_id,
        episode_id=episode or call_id,
        episode_resolved=True,
        policy=policy,
        model=policy or "upstream-model",
        request={"messages": [{"role": "user", "content": "hi"}]},
        response={"choices": [{"message": {"role": "assistant", "content": "yo"}}]},
        created_at=created_at,
    )


def where(url: str) -> dict[str, str]:
    """Each stored call's partition."""
    rows = asyncio.run(fetch_rows(url, "SELECT id, tableoid::regclass::text AS part FROM calls"))
    return {r["id"]: r["part"] for r in rows}


async def store(url: str, records: list[CallRecord]) -> int:
    database = Database(url)
    try:
        async with database.session() as session:
            return await write_calls(session, records)
    finally:
        await database.dispose()


def test_the_migration_partitions_stored_calls_and_carries_indexes_and_views_over(
    postgres: PostgresServer,
) -> None:
    url = async_database_url(postgres.create_database("partition_migration"))
    old, new = call("p", at(3)), call("p", at(0))

    async def before() -> None:
        # Stored by today's writer, then taken back to the revision before partitioning.
        await upgrade_database(url)
        assert await store(url, [old, new]) == 2
        await downgrade(url, "0012")
        database = Database(url)
        try:
            async with database.engine.begin() as connection:  # as another revision might
                await connection.execute(text("CREATE INDEX ix_calls_model ON calls (model)"))
                await connection.execute(
                    text("CREATE VIEW policy_calls AS SELECT policy, count(*) AS n FROM calls GROUP BY 1")
                )
        finally:
            await database.dispose()
        await upgrade_database(url, gateways_stopped=True)  # 0015 rewrites calls

    asyncio.run(before())
    assert where(url) == {old.id: partition_name(TODAY - timedelta(days=3)), new.id: partition_name(TODAY)}
    names = [p.name for p in asyncio.run(_partitions(url))]
    assert names[0] == partition_name(TODAY - timedelta(days=3))
    assert partition_name(TODAY + timedelta(days=14)) in names and names[-1] == "calls_default"
    indexes = {r["indexname"] for r in asyncio.run(_indexes(url))}
    assert {
        "ix_calls_model",
        "ix_calls_policy_created_at",
        "ix_calls_episode_position",
        "calls_pkey",
    } <= indexes
    assert asyncio.run(fetch_rows(url, "SELECT policy, n FROM policy_calls")) == [{"policy": "p", "n": 2}]
    # Idempotent by id: a replayed record has the id and the time it had.
    assert asyncio.run(store(url, [old, new, call("p", at(1))])) == 1

    asyncio.run(downgrade(url, "0009"))
    assert set(where(url).values()) == {"calls"}
    assert asyncio.run(fetch_rows(url, "SELECT n FROM policy_calls")) == [{"n": 3}]
    assert "ix_calls_model" in {r["indexname"] for r in asyncio.run(_indexes(url))}
    asyncio.run(upgrade_database(url, gateways_stopped=True))
    assert len(set(where(url).values())) == 3


async def downgrade(url: str, revision: str) -> None:
    database = Database(url)
    try:
        async with database.engine.begin() as connection:

            def run(sync_connection: object) -> None:
                config = alembic_config(url)
                config.attributes["connection"] = sync_connection
                command.downgrade(config, revision)

            await connection.run_sync(run)
    finally:
        await database.dispose()


async def _partitions(url: str) -> list[Any]:
    database = Database(url)
    try:
        async with database.engine.connect() as connection:
            return await list_partitions(connection)
    finally:
        await database.dispose()


async def _indexes(url: str) -> list[dict[str, Any]]:
    return await fetch_rows(url, "SELECT indexname FROM pg_indexes WHERE tablename = 'calls'")


def test_a_call_beyond_the_prepared_days_moves_into_its_day_once_created(postgres: PostgresServer) -> None:
    url = async_database_url(postgres.create_database("partition_ahead"))
    future = call("p", at(-20))

    async def scenario() -> list[str]:
        await upgrade_database(url)
        assert await store(url, [future]) == 1
        database = Database(url)
        try:
            async with database.engine.connect() as connection:
                created = await ensure_partitions(connection, TODAY + timedelta(days=10))
                await connection.commit()
        finally:
            await database.dispose()
        return created

    asyncio.run(upgrade_database(url))
    created = asyncio.run(scenario())
    assert partition_name(TODAY + timedelta(days=20)) in created
    assert where(url) == {future.id: partition_name(TODAY + timedelta(days=20))}


def test_retention_drops_a_day_only_when_all_its_calls_are_past_their_owners_retention(
    postgres: PostgresServer, tmp_path: Path
) -> None:
    url = async_database_url(postgres.create_database("partition_retention"))
    # `short` keeps 2 days, `long` 30, calls of no policy 5.
    spanning = uuid.uuid4().hex
    day20 = [call("short", at(20)), call(None, at(20)), call("short", at(20), spanning)]
    day10 = [call("short", at(10)), call("long", at(10))]
    day1 = [call("short", at(1)), call("short", at(1), spanning)]

    async def scenario() -> dict[str, Any]:
        await upgrade_database(url)
        database = Database(url)
        try:
            async with database.engine.connect() as connection:
                await ensure_partitions(connection, TODAY - timedelta(days=25), days_ahead=25)
                await connection.commit()
            async with database.session() as session:
                await create_policy(session, "short", "m", {"schedule": {"retention": {"calls_days": 2}}})
                await create_policy(session, "long", "m", {"schedule": {"retention": {"calls_days": 30}}})
                await session.commit()
            assert await store(url, day20 + day10 + day1) == 7
            async with database.session() as session:
                session.add(Reward(call_id=day20[0].id, source="feedback", value=1.0))
                session.add(Reward(call_id=day10[1].id, source="feedback", value=1.0))
                await session.execute(text("DELETE FROM rollup_marks"))  # what the writes marked
                await session.commit()
            jobs = runner(database, tmp_path)
            jobs.config = dataclasses.replace(jobs.config, retention_calls_days=5.0)
            run = await jobs.run("short", "retention")
            assert run is not None and run.status == "succeeded", run
            return run.metrics
        finally:
            await database.dispose()

    metrics = asyncio.run(scenario())
    day = partition_name(TODAY - timedelta(days=20))
    assert metrics["dropped_days"] == [day] and metrics["dropped_day_calls"] == 3
    parts = where(url)
    assert day not in {p.name for p in asyncio.run(_partitions(url))}
    # Day 10 holds a call `long` keeps: the day stays, `short`'s call in it is deleted row by row.
    assert set(parts) == {day10[1].id, *(c.id for c in day1)}
    rewards = asyncio.run(fetch_rows(url, "SELECT call_id FROM rewards"))
    assert rewards == [{"call_id": day10[1].id}]
    # The dashboard's rollup sums the dropped day again (and the feedback that went with it).
    dropped_at = datetime.fromtimestamp(day20[0].created_at, UTC)
    marks = asyncio.run(fetch_rows(url, "SELECT since, until FROM rollup_marks"))
    assert any(m["since"] <= dropped_at < m["until"] for m in marks), marks
    episodes = {r["id"] for r in asyncio.run(fetch_rows(url, "SELECT id FROM episodes"))}
    # The episode with a call on day 20 and one on day 1 keeps its remaining call.
    assert episodes == {day10[1].id, day1[0].id, spanning}
