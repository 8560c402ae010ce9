"""The dashboard's SQL aggregates against a known synthetic load, on SQLite and PostgreSQL: every call falls in
exactly one time bucket, and the reward series and totals count what was loaded."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from gateway.settings import async_database_url
from storage.dashboard import EpisodeFilter, list_episodes, reward_series, traffic_series, version_events
from storage.database import Database
from tests.conftest import query
from tests.support.synthetic_traffic import DAYS, POLICIES, VERSIONS, load


def test_time_buckets_and_totals_add_up(database_url: str) -> None:
    url = async_database_url(database_url)
    counts = asyncio.run(load(url, 600))
    rewarded = query(
        database_url, "SELECT policy, count(*) AS n FROM episodes WHERE reward IS NOT NULL GROUP BY policy"
    )

    async def read() -> None:
        database = Database(url)
        until = datetime.now(UTC) + timedelta(hours=1)
        since = until - timedelta(days=DAYS + 1)
        step = 6 * 3600
        async with database.session() as session:
            buckets = await traffic_series(session, since, until, step)
            assert sum(b.calls for b in buckets) == counts["calls"]
            assert len(buckets) <= (DAYS + 1) * 4 + 1
            starts = [b.start for b in buckets]
            assert starts == sorted(starts) and all(int(s.timestamp()) % step == 0 for s in starts)
            one = await traffic_series(session, since, until, step, POLICIES[0])
            assert 0 < sum(b.calls for b in one) < counts["calls"]
            for row in rewarded:
                points = await reward_series(session, row["policy"], since, until, step)
                assert sum(p.episodes for p in points) == row["n"]
                assert {p.version for p in points} <= set(range(VERSIONS))
            events = await version_events(session, since, until)
            assert len(events) == 2 * len(POLICIES) * (VERSIONS - 1)  # a promotion and a gate decision each
            page, cursor = await list_episodes(session, EpisodeFilter(policy=POLICIES[1]), 20)
            assert len(page) == 20 and cursor is not None and {e.policy for e in page} == {POLICIES[1]}
            following, _ = await list_episodes(session, EpisodeFilter(policy=POLICIES[1]), 20, cursor)
            assert not {e.id for e in page} & {e.id for e in following}
            assert following[0].created_at <= page[-1].created_at
        await database.dispose()

    asyncio.run(read())
