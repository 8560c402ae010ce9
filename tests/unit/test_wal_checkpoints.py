"""The capture writer's WAL checkpoints: its own commits never copy the log into the database file; the
checkpoint thread does, beside them."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import pytest
from sqlalchemy import text

from storage.database import Database
from storage.wal_checkpoints import WalCheckpointer, sqlite_path


def _write_through(database: Database, rows: int) -> None:
    async def write() -> int:
        async with database.engine.begin() as conn:
            await conn.execute(text("CREATE TABLE IF NOT EXISTS filler (body TEXT)"))
            for _ in range(rows // 100):
                await conn.execute(
                    text("INSERT INTO filler (body) VALUES (:body)"), [{"body": "x" * 1000}] * 100
                )
        async with database.engine.connect() as conn:
            setting = (await conn.execute(text("PRAGMA wal_autocheckpoint"))).scalar_one()
        await database.dispose()
        return int(setting)

    assert asyncio.run(write()) == 0


def test_the_writers_commits_leave_the_log_to_the_checkpoint_thread(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'kaizen.db'}"
    db_file, wal_file = tmp_path / "kaizen.db", tmp_path / "kaizen.db-wal"
    # A reader stays connected, as the serving process does: the last connection to close would checkpoint.
    keeper = sqlite3.connect(db_file)
    keeper.execute("PRAGMA journal_mode=WAL").fetchall()
    keeper.execute("SELECT count(*) FROM sqlite_master").fetchall()
    _write_through(Database(url, capture_writer=True), 6_000)  # about 1,500 pages: past 1,000
    # Nothing checkpointed: the rows are in the log only (SQLite alone would have copied them at 1,000 pages).
    assert wal_file.stat().st_size > 5_000_000 and db_file.stat().st_size < 1_000_000

    checkpointer = WalCheckpointer(url, interval_s=0.05)
    checkpointer.start()
    try:
        deadline = time.monotonic() + 30
        while db_file.stat().st_size < 5_000_000:
            assert time.monotonic() < deadline, "the checkpoint thread copied nothing"
            time.sleep(0.05)
    finally:
        checkpointer.stop()
    assert checkpointer.checkpoints >= 1
    assert keeper.execute("SELECT count(*) FROM filler").fetchone() == (6_000,)
    keeper.close()


def test_other_connections_keep_sqlites_automatic_checkpoint(tmp_path: Path) -> None:
    database = Database(f"sqlite+aiosqlite:///{tmp_path / 'kaizen.db'}")

    async def setting() -> int:
        async with database.engine.connect() as conn:
            value = (await conn.execute(text("PRAGMA wal_autocheckpoint"))).scalar_one()
        await database.dispose()
        return int(value)

    assert asyncio.run(setting()) == 1000


def test_sqlite_path_reads_the_file_of_any_driver() -> None:
    assert sqlite_path("sqlite:////var/lib/kaizen/kaizen.db") == "/var/lib/kaizen/kaizen.db"
    assert sqlite_path("sqlite+aiosqlite:///data/kaizen.db") == "data/kaizen.db"
    with pytest.raises(ValueError, match="not a SQLite file"):
        sqlite_path("sqlite://")
