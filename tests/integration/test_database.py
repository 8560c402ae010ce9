"""The database handle: which pooled connections are pinged before use."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import text

from gateway.settings import async_database_url
from storage.database import Database


def test_only_a_servers_pooled_connections_are_pinged_before_a_session(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A server may have dropped a pooled connection, so its reuse is pinged first; a SQLite connection is a file
    # handle that nothing drops, and a ping would only be one more round trip through the driver's thread.
    database = Database(async_database_url(database_url))
    pings: list[Any] = []

    def ping(connection: Any) -> bool:
        pings.append(connection)
        return True

    monkeypatch.setattr(database.engine.sync_engine.dialect, "do_ping", ping)

    async def three_sessions() -> list[int]:
        answers = []
        try:
            for _ in range(3):  # the first checkout connects; the next two reuse the pooled connection
                async with database.session() as session:
                    answers.append((await session.execute(text("SELECT 1"))).scalar_one())
        finally:
            await database.dispose()
        return answers

    assert asyncio.run(three_sessions()) == [1, 1, 1]
    assert len(pings) == (0 if database.is_sqlite else 2)
