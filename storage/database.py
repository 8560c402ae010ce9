"""Async engine and session factory. One `Database` per process, built from the settings' URL."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine


def _json_dumps(value: Any) -> str:
    return msgspec.json.encode(value).decode()


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets readers (SQL users, the trainer) work while the capture writer inserts.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()


def _no_autocheckpoint(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA wal_autocheckpoint=0")
    cursor.close()


class Database:
    """Owns the SQLAlchemy async engine; hands out sessions with explicit lifetimes."""

    def __init__(self, url: str, *, connect_timeout_s: float = 5.0, capture_writer: bool = False) -> None:
        """`capture_writer`: connections tuned for the capture writer's batches. On SQLite its commits never
        checkpoint the WAL (`storage.wal_checkpoints` does, beside them); on PostgreSQL every statement is
        planned for its parameters (`plan_cache_mode`), see below."""
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        # msgspec encodes and decodes the JSON columns several times faster than the stdlib json module.
        kwargs: dict[str, Any] = {
            # A server may have dropped a pooled connection (a restart, an idle timeout): a checkout pings it
            # first. A SQLite connection is a file handle, which nothing drops; its ping was one more round trip
            # through the driver's thread for every session, so every capture batch (about 140 us of CPU each,
            # docs/performance.md).
            "pool_pre_ping": not self.is_sqlite,
            "json_serializer": _json_dumps,
            "json_deserializer": msgspec.json.decode,
            "use_insertmanyvalues": False,
        }
        if self.is_sqlite:
            kwargs["connect_args"] = {"timeout": 30}
        else:
            # No JIT: on a partitioned `calls` the planner prices a lookup per episode as a scan of every day
            # partition and compiles one function per partition for it, which took 50 s for a query that runs in
            # 80 ms (measured on 10 million calls over 100 days); Kaizen's queries are short ones.
            settings = {"jit": "off"}
            if capture_writer:
                # The writer looks a batch's ids up from its first batch on, while `calls`, `episodes` and each
                # new day partition grow from empty. Until autovacuum first analyses a table, PostgreSQL reads it
                # whole for those lookups. Planned for its parameters, the list of ids is constants that it checks
                # each row against by hashing; the generic plan it settles on while the table is small holds
                # parameters, checked one by one: three lookups per batch took 25-42 ms at 13-22k rows instead
                # of 1.5-4. Planning each execution costs about 1.5 ms per batch.
                settings["plan_cache_mode"] = "force_custom_plan"
            kwargs["connect_args"] = {
                "timeout": connect_timeout_s,
                "command_timeout": 30,
                "server_settings": settings,
            }
            kwargs["pool_size"] = 5
            kwargs["max_overflow"] = 5
        self.engine: AsyncEngine = create_async_engine(url, **kwargs)
        if self.is_sqlite:
            event.listen(self.engine.sync_engine, "connect", _sqlite_pragmas)
            if capture_writer:
                event.listen(self.engine.sync_engine, "connect", _no_autocheckpoint)
        self.sessions = async_sessionmaker(self.engine, expire_on_commit=False)

    @asynccontextmanager
    async def session(self) -> AsyncIterator[AsyncSession]:
        async with self.sessions() as session:
            yield session

    async def ping(self) -> bool:
        """True when a trivial query succeeds; never raises."""
        try:
            async with self.engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
        except Exception:
            return False
        return True

    async def dispose(self) -> None:
        await self.engine.dispose()
