"""The database handle: which pooled connections are pinged before use."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from storage.database import Database


def test_a_sqlite_session_is_not_pinged_before_its_statements(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    database = Database(f"sqlite+aiosqlite:///{tmp_path / 'kaizen.db'}")
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
    assert pings == []


def test_a_server_databases_connections_are_pinged_before_use() -> None:
    database = Database("postgresql+asyncpg://kaizen@127.0.0.1:1/kaizen")  # never connected here
    assert database.engine.sync_engine.pool._pre_ping is True
