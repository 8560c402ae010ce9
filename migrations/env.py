"""Alembic environment: runs migrations over the async engine given in the config's `sqlalchemy.url`.

From the `alembic` command line (configured in pyproject.toml) the URL is passed as `-x url=...`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from alembic import context
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from storage.models import Base

target_metadata = Base.metadata

#: Indexes a revision creates on PostgreSQL alone (0019's trigram indexes for text search). The models describe
#: what every dialect has, so `alembic check` on PostgreSQL must not read these as indexes to drop.
POSTGRESQL_ONLY_INDEXES = frozenset({"ix_calls_request_trgm", "ix_calls_response_trgm"})


def _include_object(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
    return not (type_ == "index" and reflected and compare_to is None and name in POSTGRESQL_ONLY_INDEXES)


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        include_object=_include_object,
    )
    with context.begin_transaction():
        context.run_migrations()


async def _run_async(url: str) -> None:
    engine = create_async_engine(url)
    async with engine.connect() as connection:
        await connection.run_sync(_run)
        await connection.commit()
    await engine.dispose()


def run_migrations_online() -> None:
    given = context.get_x_argument(as_dictionary=True).get("url")
    url = given or context.config.get_main_option("sqlalchemy.url")
    if url is None:
        raise RuntimeError("sqlalchemy.url is not set")
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
    else:
        asyncio.run(_run_async(url))


if context.is_offline_mode():
    raise RuntimeError("offline (SQL script) migrations are not supported; use `kaizen db upgrade`")
run_migrations_online()
