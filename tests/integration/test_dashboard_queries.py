"""The dashboard's SQL aggregates against a known synthetic load, on SQLite and PostgreSQL: every call falls in
exactly one time bucket, the reward series and totals count what was loaded, and the rollup of closed buckets
adds up to exactly what the raw rows say."""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import UTC, datetime, timedelta

from sqlalchemy.ext.asyncio import AsyncSession

from gateway.settings import async_database_url
from storage.dashboard import Activity, EpisodeFilter, TrafficBucket, activity, list_episodes, version_events
from storage.database import Database
from storage.rollups import refresh_rollups, rolled_until, sum_rows, window_sums
from tests.conftest import query
from tests.support.synthetic_traffic import DAYS, POLICIES, VERSIONS, load


def test_time_buckets_and_totals_add_up(database_url: str) -> None:
    url = async_database_url(database_url)
    counts = asyncio.run(load(url, 600))
    rewarded = query(
        database_url, "SELECT policy, count(*) AS n FROM episodes WHERE reward IS NOT NULL GROUP BY policy"
    )
    feedback = query(database_url, "SELECT count(*) AS n FROM rewards WHERE source = 'feedback'")[0]["n"]

    async def read() -> None:
        database = Database(url)
        until = datetime.now(UTC) + timedelta(hours=1)
        since = until - timedelta(days=DAYS + 1)
        step = 6 * 3600
        since = datetime.fromtimestamp(int(since.timestamp()) // step * step, UTC)
        async with database.session() as session:
            raw = await activity(session, since, until, step)
        # Rolled up, every closed bucket is read from the rollup, and the charts do not change.
        report = await refresh_rollups(database)
        assert report is not None and report.rows > 0
        async with database.session() as session:
            reach = await rolled_until(session)
            assert reach is not None and since < reach < until
            summed = await activity(session, since, until, step)
            for window in (raw, summed):
                buckets = window.traffic()
                assert sum(b.calls for b in buckets) == counts["calls"]
                assert len(buckets) <= (DAYS + 1) * 4 + 1
                starts = [b.start for b in buckets]
                assert starts == sorted(starts) and all(int(s.timestamp()) % step == 0 for s in starts)
                totals = window.totals()
                assert (totals.episodes, totals.feedback) == (counts["episodes"], feedback)
                for row in rewarded:
                    points = window.rewards(row["policy"])
                    assert sum(p.episodes for p in points) == row["n"]
                    assert {p.version for p in points} <= set(range(VERSIONS))
            assert _rounded(summed.traffic()) == _rounded(raw.traffic())
            assert summed.totals() == raw.totals()
            one = await activity(session, since, until, step, POLICIES[0])
            assert 0 < sum(b.calls for b in one.traffic()) < counts["calls"]
            alone = await _raw_activity(session, since, until, step, POLICIES[0])
            assert _rounded(one.traffic()) == _rounded(alone.traffic())
            events = await version_events(session, since, until)
            assert len(events) == 2 * len(POLICIES) * (VERSIONS - 1)  # a promotion and a gate decision each
            page = await list_episodes(session, EpisodeFilter(policy=POLICIES[1]), 20)
            assert len(page.rows) == 20 and page.next is not None
            assert {e.policy for e in page.rows} == {POLICIES[1]}
            following = await list_episodes(session, EpisodeFilter(policy=POLICIES[1]), 20, page.next)
            assert not {e.id for e in page.rows} & {e.id for e in following.rows}
            assert following.rows[0].created_at <= page.rows[-1].created_at
        await database.dispose()

    asyncio.run(read())


def _rounded(buckets: list[TrafficBucket]) -> list[TrafficBucket]:
    """Sums of floats in another order differ in the last bits: compare them to a micro-millisecond."""
    return [
        dataclasses.replace(
            b, mean_latency_ms=None if b.mean_latency_ms is None else round(b.mean_latency_ms, 6)
        )
        for b in buckets
    ]


async def _raw_activity(
    session: AsyncSession, since: datetime, until: datetime, step: int, policy: str
) -> Activity:
    """The window summed from the raw rows alone, as if nothing were rolled up."""
    return Activity(await sum_rows(session, since, until, step, policy))


def test_a_version_filter_starts_at_the_versions_newest_call(database_url: str) -> None:
    url = async_database_url(database_url)
    asyncio.run(load(url, 600))
    expected = [
        r["id"]
        for r in query(
            database_url,
            "SELECT id FROM episodes e WHERE EXISTS (SELECT 1 FROM calls c WHERE c.episode_id = e.id "
            "AND c.adapter_version = 2) ORDER BY created_at DESC, id DESC",
        )
    ]

    async def read() -> None:
        database = Database(url)
        async with database.session() as session:
            seen: list[str] = []
            page = await list_episodes(session, EpisodeFilter(version=2), 25)
            seen += [e.id for e in page.rows]
            while page.next is not None:
                page = await list_episodes(session, EpisodeFilter(version=2), 25, page.next)
                seen += [e.id for e in page.rows]
            assert seen == expected and expected
            nothing = await list_episodes(session, EpisodeFilter(version=99), 25)
            assert nothing.rows == [] and nothing.next is None
        await database.dispose()

    asyncio.run(read())


def test_window_sums_switch_from_rollup_to_raw_rows_at_rolled_until(database_url: str) -> None:
    url = async_database_url(database_url)
    asyncio.run(load(url, 300))

    async def read() -> None:
        database = Database(url)
        await refresh_rollups(database)
        async with database.session() as session:
            reach = await rolled_until(session)
            assert reach is not None
            since = reach - timedelta(days=2)
            until = reach + timedelta(hours=1)
            mixed = await window_sums(session, since, until, 900)
            raw = await sum_rows(session, since, until, 900)
            assert mixed.keys() == raw.keys()
            for key, sums in raw.items():
                other = mixed[key]
                assert (other.calls, other.errors, other.episodes, other.rewarded, other.feedback) == (
                    sums.calls,
                    sums.errors,
                    sums.episodes,
                    sums.rewarded,
                    sums.feedback,
                )
                assert abs(other.latency_ms_sum - sums.latency_ms_sum) < 1e-6 * max(1.0, sums.latency_ms_sum)
        await database.dispose()

    asyncio.run(read())


def test_text_search_finds_every_match_page_by_page(database_url: str) -> None:
    """A rare and a common text, read to the end: exactly the episodes whose calls contain it, newest first.
    SQLite reads a bounded window per request (here 40 episodes) and says where it stopped; PostgreSQL asks its
    trigram indexes (here: rare below 30 matching calls, common above)."""
    url = async_database_url(database_url)
    asyncio.run(load(url, 500))
    sqlite = database_url.startswith("sqlite")

    def truth(needle: str) -> list[str]:
        return [
            r["id"]
            for r in query(
                database_url,
                "SELECT id FROM episodes e WHERE EXISTS (SELECT 1 FROM calls c WHERE c.episode_id = e.id AND "
                "(lower(CAST(c.request AS TEXT)) LIKE :p OR lower(CAST(c.response AS TEXT)) LIKE :p)) "
                "ORDER BY created_at DESC, id DESC",
                p=f"%{needle.lower()}%",
            )
        ]

    async def read(needle: str, filt: EpisodeFilter) -> tuple[list[str], int]:
        database = Database(url)
        seen: list[str] = []
        requests = 0
        async with database.session() as session:
            page = await list_episodes(session, filt, 10, text_window=40, text_candidates=30)
            requests += 1
            seen += [e.id for e in page.rows]
            while page.next is not None:
                if page.searched_to is not None:
                    assert len(page.rows) < 10 and page.next == page.searched_to
                page = await list_episodes(session, filt, 10, page.next, text_window=40, text_candidates=30)
                requests += 1
                seen += [e.id for e in page.rows]
        await database.dispose()
        return seen, requests

    rare = "customer 17 asks"  # one episode, early in the load
    found, requests = asyncio.run(read(rare, EpisodeFilter(text=rare)))
    assert found == truth(rare) and len(found) == 1
    # SQLite had to read its way back to it, a window per request; PostgreSQL found it at once.
    assert requests > 5 if sqlite else requests == 1
    common = "WARRANTY"  # a tenth of the episodes, in any case
    found, _ = asyncio.run(read(common, EpisodeFilter(text=common)))
    assert found == truth(common) and len(found) > 20  # matched by more than 30 calls
    found, _ = asyncio.run(read(common, EpisodeFilter(text=common, policy=POLICIES[0])))
    assert set(found) < set(truth(common)) and found
    assert asyncio.run(read("100%_", EpisodeFilter(text="100%_")))[0] == []  # wildcards taken literally
