"""The capture writer's PostgreSQL connections plan each statement for its parameters.

Until autovacuum first analyses a table (a fresh install, a new day partition of `calls`), PostgreSQL reads it
whole for the writer's lookups by id. Planned for its parameters, the lookup's list of ids is a list of
constants, which PostgreSQL checks each row against by hashing; in a cached generic plan it is a list of
parameters, checked one by one. Measured with 90-id batches: 25-42 ms per lookup at 13-22k rows against
1.5-4 ms. Other connections keep PostgreSQL's default."""

from __future__ import annotations

import asyncio
import statistics
import time

from sqlalchemy import bindparam, text

from gateway.settings import async_database_url
from migrations.runner import upgrade_database
from storage.database import Database
from tests.support.postgres import PostgresServer

EPISODES = 15_000
#: The writer's batch: the ids of a flush window's calls, one statement with one parameter per id.
LOOKUP = text("SELECT id FROM episodes WHERE id IN :ids FOR UPDATE").bindparams(
    bindparam("ids", expanding=True)
)


FILL = text(
    "INSERT INTO episodes (id, policy, project, source, metadata, tags, created_at, updated_at) "
    "SELECT md5(n::text), 'p', 'default', 'live', '{}', '[]', now(), now() "
    "FROM generate_series(CAST(:first AS int), CAST(:last AS int)) n"
)


async def _lookup_ms(url: str, capture_writer: bool) -> float:
    """Median time of a batch's lookup once `episodes` grew from 10 rows to 15,000 without being analysed, on a
    connection that ran the lookup while the table was small (as the writer does from its first batch)."""
    await upgrade_database(url)
    database = Database(url, capture_writer=capture_writer)
    ids = {"ids": [f"absent-{n}" for n in range(90)]}
    timings = []
    try:
        async with database.engine.connect() as conn:
            await conn.execute(text("ALTER TABLE episodes SET (autovacuum_enabled = false)"))
            await conn.execute(FILL, {"first": 1, "last": 10})
            for _ in range(10):  # more than the 5 runs after which PostgreSQL may settle on a generic plan
                await conn.execute(LOOKUP, ids)
            await conn.execute(FILL, {"first": 11, "last": EPISODES})
            for _ in range(20):
                started = time.perf_counter()
                await conn.execute(LOOKUP, ids)
                timings.append(time.perf_counter() - started)
            await conn.rollback()
    finally:
        await database.dispose()
    return statistics.median(timings) * 1000


def test_the_writers_lookups_stay_fast_on_a_table_never_analysed(postgres: PostgresServer) -> None:
    default_ms = asyncio.run(_lookup_ms(async_database_url(postgres.create_database("plans_default")), False))
    writer_ms = asyncio.run(_lookup_ms(async_database_url(postgres.create_database("plans_writer")), True))
    # Both sides on the same machine, one after the other; measured about 16 ms against 1 ms when calm.
    assert writer_ms * 4 < default_ms, (writer_ms, default_ms)


def test_only_the_writers_connections_plan_every_execution(postgres: PostgresServer) -> None:
    url = async_database_url(postgres.create_database("writer_plan_mode"))

    async def mode(capture_writer: bool) -> str:
        database = Database(url, capture_writer=capture_writer)
        try:
            async with database.engine.connect() as conn:
                return str((await conn.execute(text("SHOW plan_cache_mode"))).scalar_one())
        finally:
            await database.dispose()

    assert asyncio.run(mode(capture_writer=True)) == "force_custom_plan"
    assert asyncio.run(mode(capture_writer=False)) == "auto"
