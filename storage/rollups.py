"""Pre-summed traffic for the dashboard's overview: calls, errors, latency, tokens, episodes, rewards and
feedback per 15-minute bucket, policy and serving version (`traffic_rollups`).

A window adds up the rollup rows of its buckets before `rolled_until` and sums the raw rows only after it
(the last quarter of an hour or so), so a 30-day overview costs about what a 1-hour one does.

How the rollup stays exact:

- **Closed buckets only.** A bucket is rolled up once it ended `SETTLE_S` ago. Calls and episodes are stored
  with the time they started, normally seconds after it. Whatever writes rows stamped more than `MARK_AGE_S`
  in the past (the capture log replayed after a database outage, an import, a reward derived again for an old
  episode, feedback linked late, retention deleting) adds a mark (`rollup_marks`) in the same transaction, and
  the next refresh sums the marked buckets again. Since `MARK_AGE_S < SETTLE_S`, a row written without a mark
  lands in a bucket that is not rolled up yet, provided its transaction commits within `SETTLE_S - MARK_AGE_S`
  of reading the clock and the replicas' clocks agree that closely.
- **One refresh at a time**, whichever process runs it: the job lock `kaizen/rollups` (`storage.locks`; a
  policy name cannot contain `/`). A refresh sums marked buckets again and rolls up newly closed ones, a day of
  buckets per transaction, then deletes the marks it read and moves `rolled_until`. Marks added meanwhile
  stay for the next one; a refresh that dies changes neither, and the next one redoes its work.
- **Who refreshes:** the scheduler every `REFRESH_INTERVAL_S`, and the overview page itself when the last
  refresh is older than that (only if no other process holds the lock; otherwise it reads what is there).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import and_, case, delete, func, insert, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import aliased

from storage.database import Database
from storage.dialect import epoch_bucket, utc
from storage.locks import acquire_lock, heartbeat, lock_owner, release_lock
from storage.models import Call, Episode, Reward, RollupMark, RollupState, TrafficRollup

log = logging.getLogger(__name__)

ROLLUP_STEP_S = 900
"""The rollup's bucket: 15 minutes, the 24-hour window's step, so every window from 24 hours up reads it."""
SETTLE_S = 600
"""A bucket is rolled up this long after it ended."""
MARK_AGE_S = 300
"""A write of rows stamped longer ago than this marks their buckets to be summed again."""
REFRESH_INTERVAL_S = 60.0
"""How often the scheduler refreshes, and how old a refresh may be before the overview page does one."""
CHUNK_S = 86_400
"""Buckets summed per transaction: a day, so a writer never waits long on SQLite's write lock."""
LOCK_KEY = "kaizen/rollups"
LOCK_TTL_S = 120.0
_STATE_ID = 1

Key = tuple[int, str, int | None]
"""(bucket start in Unix seconds, policy or '' for none, serving version or None for the base model)."""


@dataclass
class Sums:
    """What one bucket, policy and version add up to. Mean latency and mean reward are sum / count."""

    calls: int = 0
    errors: int = 0
    latency_ms_sum: float = 0.0
    latency_ms_max: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    episodes: int = 0
    rewarded: int = 0
    reward_sum: float = 0.0
    feedback: int = 0

    def add(self, other: Sums) -> None:
        self.calls += other.calls
        self.errors += other.errors
        self.latency_ms_sum += other.latency_ms_sum
        if other.latency_ms_max is not None:
            self.latency_ms_max = (
                other.latency_ms_max
                if self.latency_ms_max is None
                else max(self.latency_ms_max, other.latency_ms_max)
            )
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.episodes += other.episodes
        self.rewarded += other.rewarded
        self.reward_sum += other.reward_sum
        self.feedback += other.feedback


def _merge(into: dict[Key, Sums], more: dict[Key, Sums]) -> None:
    for key, sums in more.items():
        into.setdefault(key, Sums()).add(sums)


def floor_bucket(at: datetime, step_s: int = ROLLUP_STEP_S) -> datetime:
    return datetime.fromtimestamp(int(utc(at).timestamp()) // step_s * step_s, UTC)


def _ceil_bucket(at: datetime) -> datetime:
    start = floor_bucket(at)
    return start if start == utc(at) else start + timedelta(seconds=ROLLUP_STEP_S)


# ------------------------------------------------------------------------------------------- summing rows
async def sum_rows(
    session: AsyncSession, since: datetime, until: datetime, step_s: int, policy: str | None = None
) -> dict[Key, Sums]:
    """The raw rows of [since, until) summed per `step_s` bucket, policy and serving version."""
    out: dict[Key, Sums] = {}
    bucket = epoch_bucket(session, Call.created_at, step_s).label("bucket")
    owner = func.coalesce(Call.policy, "")
    calls = (
        select(
            bucket,
            owner.label("policy"),
            Call.adapter_version,
            func.count().label("n"),
            func.sum(case((Call.status != "ok", 1), else_=0)).label("errors"),
            func.sum(Call.latency_ms).label("latency_sum"),
            func.max(Call.latency_ms).label("latency_max"),
            func.coalesce(func.sum(Call.prompt_tokens), 0).label("prompt"),
            func.coalesce(func.sum(Call.completion_tokens), 0).label("completion"),
        )
        .where(Call.created_at >= since, Call.created_at < until)
        .group_by(bucket, owner, Call.adapter_version)
    )
    if policy is not None:
        calls = calls.where(Call.policy == policy)
    for row in await session.execute(calls):
        sums = out.setdefault((int(row.bucket), row.policy, row.adapter_version), Sums())
        sums.calls = int(row.n)
        sums.errors = int(row.errors or 0)
        sums.latency_ms_sum = float(row.latency_sum or 0.0)
        sums.latency_ms_max = None if row.latency_max is None else float(row.latency_max)
        sums.prompt_tokens = int(row.prompt or 0)
        sums.completion_tokens = int(row.completion or 0)

    # An episode counts in the bucket it started in, for the version that served its first call.
    first = aliased(Call, name="first_call")
    bucket = epoch_bucket(session, Episode.created_at, step_s).label("bucket")
    owner = func.coalesce(Episode.policy, "")
    episodes = (
        select(
            bucket,
            owner.label("policy"),
            first.adapter_version,
            func.count().label("n"),
            func.count(Episode.reward).label("rewarded"),
            func.coalesce(func.sum(Episode.reward), 0.0).label("reward_sum"),
        )
        .select_from(Episode)
        .outerjoin(first, and_(first.episode_id == Episode.id, first.position == 0))
        .where(Episode.created_at >= since, Episode.created_at < until)
        .group_by(bucket, owner, first.adapter_version)
    )
    if policy is not None:
        episodes = episodes.where(Episode.policy == policy)
    for row in await session.execute(episodes):
        sums = out.setdefault((int(row.bucket), row.policy, row.adapter_version), Sums())
        sums.episodes = int(row.n)
        sums.rewarded = int(row.rewarded)
        sums.reward_sum = float(row.reward_sum or 0.0)

    # Feedback rows count when they arrived, for the policy of their episode (none while unlinked).
    bucket = epoch_bucket(session, Reward.created_at, step_s).label("bucket")
    owner = func.coalesce(Episode.policy, "")
    feedback = (
        select(bucket, owner.label("policy"), func.count().label("n"))
        .select_from(Reward)
        .outerjoin(Episode, Episode.id == Reward.episode_id)
        .where(Reward.source == "feedback", Reward.created_at >= since, Reward.created_at < until)
        .group_by(bucket, owner)
    )
    if policy is not None:
        feedback = feedback.where(Episode.policy == policy)
    for row in await session.execute(feedback):
        out.setdefault((int(row.bucket), row.policy, None), Sums()).feedback = int(row.n)
    return out


async def rolled_sums(
    session: AsyncSession, since: datetime, until: datetime, step_s: int, policy: str | None = None
) -> dict[Key, Sums]:
    """The rollup rows of [since, until) added up per `step_s` bucket (a multiple of `ROLLUP_STEP_S`)."""
    bucket = epoch_bucket(session, TrafficRollup.bucket_start, step_s).label("bucket")
    query = (
        select(
            bucket,
            TrafficRollup.policy,
            TrafficRollup.adapter_version,
            func.sum(TrafficRollup.calls).label("calls"),
            func.sum(TrafficRollup.errors).label("errors"),
            func.sum(TrafficRollup.latency_ms_sum).label("latency_sum"),
            func.max(TrafficRollup.latency_ms_max).label("latency_max"),
            func.sum(TrafficRollup.prompt_tokens).label("prompt"),
            func.sum(TrafficRollup.completion_tokens).label("completion"),
            func.sum(TrafficRollup.episodes).label("episodes"),
            func.sum(TrafficRollup.rewarded).label("rewarded"),
            func.sum(TrafficRollup.reward_sum).label("reward_sum"),
            func.sum(TrafficRollup.feedback).label("feedback"),
        )
        .where(TrafficRollup.bucket_start >= since, TrafficRollup.bucket_start < until)
        .group_by(bucket, TrafficRollup.policy, TrafficRollup.adapter_version)
    )
    if policy is not None:
        query = query.where(TrafficRollup.policy == policy)
    return {
        (int(r.bucket), r.policy, r.adapter_version): Sums(
            int(r.calls),
            int(r.errors),
            float(r.latency_sum),
            None if r.latency_max is None else float(r.latency_max),
            int(r.prompt),
            int(r.completion),
            int(r.episodes),
            int(r.rewarded),
            float(r.reward_sum),
            int(r.feedback),
        )
        for r in await session.execute(query)
    }


async def rolled_until(session: AsyncSession) -> datetime | None:
    """Where the rollup ends: every bucket before this time is summed in `traffic_rollups`."""
    value = await session.scalar(select(RollupState.rolled_until).where(RollupState.id == _STATE_ID))
    return utc(value) if value is not None else None


async def window_sums(
    session: AsyncSession, since: datetime, until: datetime, step_s: int, policy: str | None = None
) -> dict[Key, Sums]:
    """[since, until) summed per `step_s` bucket, policy and version: from the rollup up to `rolled_until`
    when the buckets line up with it, from the raw rows after that (and for finer steps)."""
    split = since
    if step_s % ROLLUP_STEP_S == 0 and floor_bucket(since) == since:
        reach = await rolled_until(session)
        if reach is not None:
            split = min(max(reach, since), until)
    out: dict[Key, Sums] = {}
    if split > since:
        _merge(out, await rolled_sums(session, since, split, step_s, policy))
    if until > split:
        _merge(out, await sum_rows(session, split, until, step_s, policy))
    return out


# ------------------------------------------------------------------------------------------- marks
def _spans(buckets: Iterable[datetime]) -> list[tuple[datetime, datetime]]:
    """Consecutive bucket starts joined into [since, until) spans."""
    spans: list[tuple[datetime, datetime]] = []
    step = timedelta(seconds=ROLLUP_STEP_S)
    for start in sorted(set(buckets)):
        if spans and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], start + step)
        else:
            spans.append((start, start + step))
    return spans


async def mark_changed(session: AsyncSession, stamps: Iterable[datetime]) -> None:
    """Note, in the caller's transaction, that rows stamped at these times were written, changed or deleted:
    the buckets of those older than `MARK_AGE_S` are summed again at the next refresh (newer ones are not
    rolled up yet). Costs nothing when every stamp is recent, as on the capture path."""
    horizon = datetime.now(UTC) - timedelta(seconds=MARK_AGE_S)
    old = [floor_bucket(at) for at in stamps if utc(at) < horizon]
    if old:
        await session.execute(
            insert(RollupMark), [{"since": since, "until": until} for since, until in _spans(old)]
        )


def span_marks(spans: Iterable[tuple[datetime, datetime]]) -> list[dict[str, datetime]]:
    """Rows of `rollup_marks` for these spans, widened to whole buckets (a single instant: its bucket)."""
    step = timedelta(seconds=ROLLUP_STEP_S)
    return [
        {"since": floor_bucket(since), "until": max(_ceil_bucket(until), floor_bucket(since) + step)}
        for since, until in spans
    ]


async def mark_span(session: AsyncSession, since: datetime, until: datetime) -> None:
    """Note, in the caller's transaction, that anything in [since, until) may have changed."""
    await session.execute(insert(RollupMark).values(since=floor_bucket(since), until=_ceil_bucket(until)))


# ------------------------------------------------------------------------------------------- refresh
@dataclass
class RefreshReport:
    """What one refresh did."""

    rolled_until: datetime | None
    marks: int = 0
    buckets: int = 0  # 15-minute buckets summed again or for the first time
    rows: int = 0  # rollup rows written
    seconds: float = 0.0
    spans: list[tuple[datetime, datetime]] = field(default_factory=list)


async def _first_row_at(session: AsyncSession) -> datetime | None:
    """The oldest timestamp the rollup would sum (each an index's first entry)."""
    found = [
        await session.scalar(select(func.min(Call.created_at))),
        await session.scalar(select(func.min(Episode.created_at))),
        await session.scalar(select(func.min(Reward.created_at))),
    ]
    stamps = [utc(at) for at in found if at is not None]
    return min(stamps) if stamps else None


def _union(spans: Sequence[tuple[datetime, datetime]]) -> list[tuple[datetime, datetime]]:
    joined: list[tuple[datetime, datetime]] = []
    for since, until in sorted(spans):
        if joined and since <= joined[-1][1]:
            joined[-1] = (joined[-1][0], max(joined[-1][1], until))
        else:
            joined.append((since, until))
    return joined


async def _resum(session: AsyncSession, since: datetime, until: datetime) -> int:
    """Replace the rollup rows of [since, until) by sums of the raw rows; returns the rows written."""
    await session.execute(
        delete(TrafficRollup).where(TrafficRollup.bucket_start >= since, TrafficRollup.bucket_start < until)
    )
    sums = await sum_rows(session, since, until, ROLLUP_STEP_S)
    rows: list[dict[str, Any]] = [
        {
            "bucket_start": datetime.fromtimestamp(bucket, UTC),
            "policy": policy,
            "adapter_version": version,
            "calls": s.calls,
            "errors": s.errors,
            "latency_ms_sum": s.latency_ms_sum,
            "latency_ms_max": s.latency_ms_max,
            "prompt_tokens": s.prompt_tokens,
            "completion_tokens": s.completion_tokens,
            "episodes": s.episodes,
            "rewarded": s.rewarded,
            "reward_sum": s.reward_sum,
            "feedback": s.feedback,
        }
        for (bucket, policy, version), s in sorted(sums.items(), key=lambda item: (item[0][0], item[0][1]))
    ]
    if rows:
        await session.execute(insert(TrafficRollup), rows)
    return len(rows)


async def _bring_up_to_date(database: Database, now: datetime) -> RefreshReport:
    started = time.perf_counter()
    target = floor_bucket(now - timedelta(seconds=SETTLE_S))
    async with database.session() as session:
        state = await session.get(RollupState, _STATE_ID)
        reach = utc(state.rolled_until) if state is not None and state.rolled_until is not None else None
        marks = (await session.execute(select(RollupMark.id, RollupMark.since, RollupMark.until))).all()
        if reach is None:
            first = await _first_row_at(session)
            reach = floor_bucket(first) if first is not None else target
    # Marks at or after `reach` concern buckets that are summed for the first time anyway.
    wanted = [(floor_bucket(m.since), min(_ceil_bucket(m.until), reach)) for m in marks]
    if target > reach:
        wanted.append((reach, target))
    spans = _union([(since, until) for since, until in wanted if since < until])
    report = RefreshReport(max(reach, target), marks=len(marks), spans=spans)
    for since, until in spans:
        start = since
        while start < until:
            end = min(until, start + timedelta(seconds=CHUNK_S))
            async with database.session() as session:
                report.rows += await _resum(session, start, end)
                await session.commit()
            report.buckets += int((end - start).total_seconds()) // ROLLUP_STEP_S
            start = end
    async with database.session() as session:
        ids = [m.id for m in marks]
        for offset in range(0, len(ids), 500):
            await session.execute(delete(RollupMark).where(RollupMark.id.in_(ids[offset : offset + 500])))
        state = await session.get(RollupState, _STATE_ID)
        if state is None:
            state = RollupState(id=_STATE_ID)
            session.add(state)
        state.rolled_until = report.rolled_until
        state.refreshed_at = now
        await session.commit()
    report.seconds = time.perf_counter() - started
    return report


async def refresh_rollups(database: Database, *, now: datetime | None = None) -> RefreshReport | None:
    """Bring the rollup up to date; None when another process is doing so right now."""
    owner = lock_owner()
    async with database.session() as session:
        if not await acquire_lock(session, LOCK_KEY, owner, "rollups", LOCK_TTL_S):
            return None
    try:
        async with heartbeat(database, LOCK_KEY, owner, LOCK_TTL_S):
            report = await _bring_up_to_date(database, now or datetime.now(UTC))
    finally:
        async with database.session() as session:
            await release_lock(session, LOCK_KEY, owner)
    if report.buckets:
        log.info(
            "rollups: %d buckets summed (%d marks) in %.2f s, up to %s",
            report.buckets,
            report.marks,
            report.seconds,
            report.rolled_until,
        )
    return report


async def refresh_if_stale(database: Database, max_age_s: float = REFRESH_INTERVAL_S) -> RefreshReport | None:
    """A refresh when the last one (by any process) is older than `max_age_s`; None when it was fresh or
    another process is refreshing right now."""
    async with database.session() as session:
        refreshed = await session.scalar(select(RollupState.refreshed_at).where(RollupState.id == _STATE_ID))
    if refreshed is not None and datetime.now(UTC) - utc(refreshed) < timedelta(seconds=max_age_s):
        return None
    return await refresh_rollups(database)
