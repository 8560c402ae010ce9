"""When a version starts serving (`adapters.serving_since`), on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from gateway.settings import async_database_url
from migrations.runner import upgrade_database
from storage.database import Database
from storage.policies import (
    activate_version,
    add_adapter,
    create_policy,
    get_adapter,
    list_adapters,
    mark_serving,
)

B = datetime(2026, 11, 2, 8, 0, tzinfo=UTC)
MINUTE = timedelta(minutes=1)


def test_a_version_serves_from_the_first_time_it_did(database_url: str) -> None:
    async def scenario() -> None:
        url = async_database_url(database_url)
        await upgrade_database(url)
        database = Database(url)
        try:
            async with database.session() as session:
                policy = await create_policy(session, "bot", "base")
                for version in range(3):
                    await add_adapter(session, policy.id, version, f"/adapters/bot/{version}")
                never = await get_adapter(session, policy.id, 0)
                assert never is not None and never.serving_since is None
                before = datetime.now(UTC)
                await activate_version(session, policy.id, 0)  # promotion: serving from now
                promoted = await get_adapter(session, policy.id, 0)
                assert promoted is not None
                first = promoted.serving_since
                assert first is not None and before <= first.replace(tzinfo=UTC) <= datetime.now(UTC)
                await mark_serving(session, policy.id, 1, B)  # a canary began
                await mark_serving(session, policy.id, 1, B + MINUTE)  # and another: the first time stays
                await activate_version(session, policy.id, 1)
                await activate_version(session, policy.id, 0)  # rolled back to
                await session.commit()
                since = {a.version: a.serving_since for a in await list_adapters(session, policy.id)}
                assert since[0] is not None and since[0].replace(tzinfo=UTC) == first.replace(tzinfo=UTC)
                assert since[1] is not None and since[1].replace(tzinfo=UTC) == B
                assert since[2] is None
        finally:
            await database.dispose()

    asyncio.run(scenario())
