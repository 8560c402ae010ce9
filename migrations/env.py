"""Alembic environment: runs migrations over the async engine given in the config's `sqlalchemy.url`.

From the `alembic` command line (configured in pyproject.toml) the URL is passed as `-x url=...`.
"""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from storage.models import Base

target_metadata = Base.metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
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
