"""The day partitions of `calls` on PostgreSQL: created ahead of time, dropped whole by retention.

Since revision 0015, `calls` on PostgreSQL is partitioned by `created_at` (declarative range partitioning), one
partition per UTC day (`calls_YYYYMMDD`), plus `calls_default` for anything no day partition covers, so an insert
never fails for want of a partition. Partitions are created `DAYS_AHEAD` days ahead at every start and by the
scheduler; a day whose partition is created after rows landed in the default one has them moved into it.

Retention drops a day's partition when every call in it is past its owner's retention (each policy has its own
`calls_days`, calls no policy owns follow the process-wide setting): a `DROP TABLE` instead of deleting the rows one
by one. Days that still hold calls some owner keeps are left to the row-by-row deletes. SQLite is not partitioned:
everything here is a no-op there.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from sqlalchemy import insert, text
from sqlalchemy.ext.asyncio import AsyncConnection

from storage.calls import CALL_CLOCK_SLACK
from storage.models import RollupMark
from storage.rollups import span_marks

log = logging.getLogger(__name__)

#: Days of partitions kept ready beyond today.
DAYS_AHEAD = 14
#: Serialises partition changes of every process on the database ("calls" in ASCII).
_LOCK = 0x63616C6C73
_BOUNDS = re.compile(r"FOR VALUES FROM \((?P<lo>[^)]*)\) TO \((?P<hi>[^)]*)\)")
_CHUNK = 1000


@dataclass(frozen=True)
class Partition:
    name: str
    lower: datetime | None  # None: MINVALUE
    upper: datetime | None  # None: MAXVALUE; the default partition has neither


def _bound(value: str) -> datetime | None:
    value = value.strip().strip("'")
    if value in ("MINVALUE", "MAXVALUE"):
        return None
    parsed = datetime.fromisoformat(value)
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def partition_name(day: date) -> str:
    return f"calls_{day:%Y%m%d}"


def _day_start(day: date) -> datetime:
    return datetime(day.year, day.month, day.day, tzinfo=UTC)


async def is_partitioned(connection: AsyncConnection) -> bool:
    """True on PostgreSQL once `calls` is partitioned (revision 0015)."""
    if connection.dialect.name != "postgresql":
        return False
    found = await connection.scalar(
        text(
            "SELECT 1 FROM pg_partitioned_table p JOIN pg_class c ON c.oid = p.partrelid "
            "WHERE c.relname = 'calls' AND pg_table_is_visible(c.oid)"
        )
    )
    return found is not None


async def list_partitions(connection: AsyncConnection) -> list[Partition]:
    """The partitions of `calls`, oldest first (the default partition last)."""
    rows = await connection.execute(
        text(
            "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
            "JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent "
            "WHERE p.relname = 'calls' AND pg_table_is_visible(p.oid)"
        )
    )
    days: list[Partition] = []
    default: list[Partition] = []
    for name, bound in rows:
        match = _BOUNDS.search(bound)
        if match is None:
            default.append(Partition(name, None, None))
        else:
            days.append(Partition(name, _bound(match["lo"]), _bound(match["hi"])))
    days.sort(key=lambda p: p.lower or datetime.min.replace(tzinfo=UTC))
    return days + default


async def ensure_partitions(
    connection: AsyncConnection, today: date, days_ahead: int = DAYS_AHEAD
) -> list[str]:
    """Create the day partitions from `today` to `days_ahead` days later that are missing; returns their names.

    A day's rows that landed in the default partition meanwhile are moved into the new one. The caller commits.
    """
    if not await is_partitioned(connection):
        return []
    await connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _LOCK})
    existing = {p.name for p in await list_partitions(connection)}
    created = []
    for offset in range(days_ahead + 1):
        day = today + timedelta(days=offset)
        name = partition_name(day)
        if name in existing:
            continue
        lower, upper = _day_start(day), _day_start(day + timedelta(days=1))
        # Created detached and attached with its rows: attaching takes a weaker lock on `calls` than creating a
        # partition in place, so captured calls keep being inserted meanwhile.
        await connection.execute(
            text(f'CREATE TABLE "{name}" (LIKE calls INCLUDING DEFAULTS INCLUDING CONSTRAINTS)')
        )
        await connection.execute(
            text(
                f"WITH moved AS (DELETE FROM calls_default WHERE created_at >= :lower AND created_at < :upper "
                f'RETURNING *) INSERT INTO "{name}" SELECT * FROM moved'
            ),
            {"lower": lower, "upper": upper},
        )
        await connection.execute(
            text(
                f"ALTER TABLE calls ATTACH PARTITION \"{name}\" FOR VALUES FROM ('{lower.isoformat()}') "
                f"TO ('{upper.isoformat()}')"
            )
        )
        created.append(name)
    if created:
        log.info("created call partitions %s", ", ".join(created))
    return created


@dataclass
class DroppedDays:
    """What dropping whole day partitions removed."""

    partitions: list[str]
    calls: int = 0
    episodes: int = 0


async def drop_expired_partitions(
    connection: AsyncConnection, cutoffs: Mapping[str, datetime | None], unowned: datetime | None
) -> DroppedDays:
    """Drop every day partition whose calls are all past their owner's retention. Commits, once per day.

    `cutoffs[policy]` is the time before which a call of that policy may go, `unowned` the same for calls no
    policy owns (`None`: kept forever). A day is dropped when it ends before the cutoff of every owner of a call
    in it; an empty day, when it ends before every cutoff there is (a late write could still land in it otherwise
    from any owner). Rewards and stored responses of its calls go with it, and so do its episodes that have no call left elsewhere
    (with their rewards and stitch keys). Dropping a partition locks `calls` until its transaction commits, so
    each day is one short transaction of its own: capture waits milliseconds, not for the whole run.
    """
    dropped = DroppedDays([])
    if not await is_partitioned(connection):
        return dropped
    await connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": _LOCK})
    try:
        for partition in await list_partitions(connection):
            if partition.upper is None or partition.name == "calls_default":
                continue
            owners = await _owners(connection, partition.name)
            applying = (
                [cutoffs.get(owner, unowned) if owner is not None else unowned for owner in owners]
                if owners
                else [*cutoffs.values(), unowned]
            )
            if any(cutoff is None or partition.upper > cutoff for cutoff in applying):
                continue
            table = f'"{partition.name}"'
            episodes = list(await connection.scalars(text(f"SELECT DISTINCT episode_id FROM {table}")))
            count, oldest = (
                await connection.execute(text(f"SELECT count(*), min(created_at) FROM {table}"))
            ).one()
            dropped.calls += int(count or 0)
            rewards = await connection.execute(
                text(
                    f"DELETE FROM rewards r USING {table} c WHERE r.call_id = c.id RETURNING r.source, r.created_at"
                )
            )
            feedback = [at for source, at in rewards if source == "feedback"]
            await connection.execute(text(f"DELETE FROM responses r USING {table} c WHERE r.call_id = c.id"))
            await connection.commit()
            await connection.execute(text(f"ALTER TABLE calls DETACH PARTITION {table}"))
            await connection.execute(text(f"DROP TABLE {table}"))
            await connection.commit()
            orphans, orphans_feedback = await _drop_orphaned_episodes(connection, episodes)
            dropped.episodes += orphans
            # The dashboard's rollup counted these calls and episodes by start, and feedback by arrival.
            spans = [(at, at) for at in [*feedback, *orphans_feedback]]
            if oldest is not None and partition.upper is not None:
                spans.append((oldest - CALL_CLOCK_SLACK, partition.upper))
            if spans:
                await connection.execute(insert(RollupMark), span_marks(spans))
            await connection.commit()
            dropped.partitions.append(partition.name)
    finally:
        await connection.rollback()  # a failed day leaves its transaction aborted; the lock outlives it
        await connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": _LOCK})
        await connection.commit()
    if dropped.partitions:
        log.info(
            "dropped call partitions %s (%d calls, %d episodes)",
            ", ".join(dropped.partitions),
            dropped.calls,
            dropped.episodes,
        )
    return dropped


async def _owners(connection: AsyncConnection, table: str) -> list[str | None]:
    """The distinct `policy` values of a partition, found by walking its policy index (one index descent per
    value, not a scan of the day's rows)."""
    rows = await connection.execute(
        text(
            f"WITH RECURSIVE owners(policy) AS ("
            f'  (SELECT policy FROM "{table}" WHERE policy IS NOT NULL ORDER BY policy LIMIT 1)'
            f"  UNION ALL"
            f'  SELECT (SELECT policy FROM "{table}" c WHERE c.policy > owners.policy ORDER BY c.policy LIMIT 1)'
            f"  FROM owners WHERE owners.policy IS NOT NULL"
            f") SELECT policy FROM owners WHERE policy IS NOT NULL"
        )
    )
    owners: list[str | None] = [row[0] for row in rows]
    if await connection.scalar(text(f'SELECT EXISTS (SELECT 1 FROM "{table}" WHERE policy IS NULL)')):
        owners.append(None)
    return owners


async def _drop_orphaned_episodes(
    connection: AsyncConnection, episode_ids: Sequence[str]
) -> tuple[int, list[datetime]]:
    """Delete those of `episode_ids` that have no call any more, with their rewards and stitch keys; returns how
    many, and when the feedback among those rewards arrived."""
    deleted = 0
    feedback: list[datetime] = []
    for start in range(0, len(episode_ids), _CHUNK):
        chunk = list(episode_ids[start : start + _CHUNK])
        orphans = list(
            await connection.scalars(
                text(
                    # One index probe per episode, from its start on: as a NOT EXISTS the planner would hash
                    # every call of the table instead.
                    "SELECT e.id FROM episodes e LEFT JOIN LATERAL (SELECT 1 AS found FROM calls c "
                    "WHERE c.episode_id = e.id AND c.created_at >= e.created_at - CAST(:slack AS interval) LIMIT 1) x "
                    "ON true WHERE e.id = ANY(:ids) AND x.found IS NULL"
                ),
                {"ids": chunk, "slack": CALL_CLOCK_SLACK},
            )
        )
        if not orphans:
            continue
        rewards = await connection.execute(
            text("DELETE FROM rewards WHERE episode_id = ANY(:ids) RETURNING source, created_at"),
            {"ids": orphans},
        )
        feedback += [at for source, at in rewards if source == "feedback"]
        await connection.execute(
            text("DELETE FROM stitch_keys WHERE episode_id = ANY(:ids)"), {"ids": orphans}
        )
        await connection.execute(text("DELETE FROM episodes WHERE id = ANY(:ids)"), {"ids": orphans})
        deleted += len(orphans)
    return deleted, feedback
