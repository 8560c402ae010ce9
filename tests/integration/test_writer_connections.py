"""The capture writer's PostgreSQL connections plan each statement for its parameters.

Measured on a fresh database (`write_calls`, 90-call batches): with PostgreSQL's default plan cache the three
lookups by id of a batch slowed from 1-4 ms to 25-42 ms as `calls` and `episodes` grew to 13-22k rows before
autovacuum first analysed them, and fell back to under 1 ms after an ANALYZE; planned per execution they
stayed at 1.5-4 ms throughout. Other connections keep PostgreSQL's default."""

from __future__ import annotations

import asyncio

from sqlalchemy import text

from gateway.settings import async_database_url
from storage.database import Database
from tests.support.postgres import PostgresServer


async def _plan_cache_mode(url: str, capture_writer: bool) -> str:
    database = Database(url, capture_writer=capture_writer)
    try:
        async with database.engine.connect() as conn:
            return str((await conn.execute(text("SHOW plan_cache_mode"))).scalar_one())
    finally:
        await database.dispose()


def test_only_the_writers_connections_plan_every_execution(postgres: PostgresServer) -> None:
    url = async_database_url(postgres.create_database("writer_plans"))
    assert asyncio.run(_plan_cache_mode(url, capture_writer=True)) == "force_custom_plan"
    assert asyncio.run(_plan_cache_mode(url, capture_writer=False)) == "auto"
