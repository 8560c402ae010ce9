"""Read the database the way an operator would: a separate connection, not the gateway's, rows as plain dicts;
and run the storage layer's functions on it in one transaction, as a command would."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from gateway.settings import async_database_url
from storage.database import Database

T = TypeVar("T")


async def fetch_rows(url: str, sql: str, **params: Any) -> list[dict[str, Any]]:
    """The rows of one query."""
    engine = create_async_engine(async_database_url(url))
    try:
        async with engine.connect() as conn:
            result = await conn.execute(text(sql), params)
            return [dict(row._mapping) for row in result]
    finally:
        await engine.dispose()


def in_session(url: str, job: Callable[[AsyncSession], Awaitable[T]]) -> T:
    """`job(session)` in one transaction, committed when it returns."""

    async def run() -> T:
        database = Database(async_database_url(url))
        try:
            async with database.session() as session:
                result = await job(session)
                await session.commit()
                return result
        finally:
            await database.dispose()

    return asyncio.run(run())
