"""Read the database the way an operator would: a separate connection, not the gateway's, rows as plain dicts."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from gateway.settings import async_database_url


async def fetch_rows(url: str, sql: str, **params: Any) -> list[dict[str, Any]]:
    """The rows of one query."""
    engine = create_async_engine(async_database_url(url))
    try:
        async with engine.connect() as conn:
            result = await conn.execute(text(sql), params)
            return [dict(row._mapping) for row in result]
    finally:
        await engine.dispose()
