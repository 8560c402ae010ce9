"""Apply Alembic migrations programmatically (`kaizen db upgrade`, and `kaizen serve` at start), and open a
migrated database for the one-shot commands.

It lives beside the migrations it runs, so the dependency points one way: migrations use storage's models,
storage never imports migrations.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from storage.database import Database
from storage.partitions import ensure_partitions


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(Path(__file__).parent))
    config.set_main_option("sqlalchemy.url", url)
    return config


def known_revisions() -> list[str]:
    """The schema revisions this code can upgrade from, newest (the head) first."""
    scripts = ScriptDirectory.from_config(alembic_config(""))
    return [script.revision for script in scripts.walk_revisions()]


#: The PostgreSQL advisory lock key that serialises schema upgrades ("kaizen" in ASCII).
_MIGRATION_LOCK = 0x6B61697A656E


async def upgrade_database(url: str, revision: str = "head") -> None:
    """Bring the database at `url` (an async SQLAlchemy URL) to `revision`."""
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    engine = create_async_engine(url)
    try:
        async with engine.begin() as connection:
            if connection.dialect.name == "postgresql":
                # Replicas started together upgrade one database: one at a time, the others then find it current.
                await connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK})

            def _upgrade(sync_connection: object) -> None:
                config = alembic_config(url)
                config.attributes["connection"] = sync_connection
                command.upgrade(config, revision)

            await connection.run_sync(_upgrade)
            # Every start keeps the day partitions of `calls` (PostgreSQL) ready ahead of the clock.
            await ensure_partitions(connection, datetime.now(UTC).date())
    finally:
        await engine.dispose()


def upgrade_database_sync(url: str, revision: str = "head") -> None:
    asyncio.run(upgrade_database(url, revision))


@asynccontextmanager
async def open_database(url: str, *, migrate: bool = True) -> AsyncIterator[Database]:
    """A command's database: migrated to head first (unless `migrate` is off), disposed when the command ends."""
    if migrate:
        await upgrade_database(url)
    database = Database(url)
    try:
        yield database
    finally:
        await database.dispose()
