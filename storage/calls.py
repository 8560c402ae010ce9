"""Repository functions for captured calls and their episodes.

`write_calls` is idempotent (a call id is written at most once), so a batch may be replayed from the spool after
a failure whose outcome was unknown without creating duplicates.
"""

from __future__ import annotations

import sqlite3
from collections import defaultdict
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from itertools import chain
from typing import Any, cast

import asyncpg
import msgspec
from sqlalchemy import (
    JSON,
    ColumnElement,
    CompoundSelect,
    DateTime,
    Table,
    bindparam,
    false,
    func,
    literal,
    null,
    select,
    true,
    union_all,
    update,
)
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from storage.models import Base, Call, Episode, StitchKey, StoredResponse
from storage.records import CallRecord
from storage.rollups import mark_changed

# Statements built once with expanding parameters: the capture writer runs them for every batch, and building
# an IN clause from a Python list costs per element.
_STITCHED = select(StitchKey.hash, StitchKey.episode_id).where(
    StitchKey.hash.in_(bindparam("hashes", expanding=True))
)


# One round trip for what a batch needs to know first: which of its call ids are stored already (project NULL),
# and the project of each of its episodes that exists. The writer's thread waits for the interpreter lock after
# every round trip while the serving thread is busy, so each one saved shortens a batch under load.
def _known(*bounds: ColumnElement[bool]) -> CompoundSelect[Any]:
    return union_all(
        select(true().label("stored"), Call.id, null().label("project")).where(
            Call.id.in_(bindparam("ids", expanding=True)), *bounds
        ),
        select(false(), Episode.id, Episode.project).where(
            Episode.id.in_(bindparam("episodes", expanding=True))
        ),
    )


_KNOWN = _known()
# PostgreSQL: a stored copy of a record has the record's own time (records are written, spooled and replayed as
# they were made), so the batch's time span bounds the search to the day partitions of those times, instead of one
# index per day of retention.
_KNOWN_IN_SPAN = _known(
    Call.created_at.between(
        bindparam("since", type_=Call.created_at.type), bindparam("until", type_=Call.created_at.type)
    )
)
# Where each episode's stored calls end: the next position, and the latest time (a call that arrives later but was
# made earlier, from another replica's writer, is slotted in by time).
_LAST = (
    select(Call.episode_id, func.max(Call.position), func.max(Call.created_at))
    .where(Call.episode_id.in_(bindparam("episodes", expanding=True)))
    .group_by(Call.episode_id)
)
#: A call is made after the episode it belongs to starts, but another replica's clock may be a little behind:
#: lookups of an episode's calls read from its start less this on, so that on PostgreSQL they read only the day
#: partitions from then on instead of one index per day of retention.
CALL_CLOCK_SLACK = timedelta(hours=1)
# PostgreSQL: the same, read from the day partitions since each episode started.
_SINCE_START = (
    select(func.max(Call.position).label("position"), func.max(Call.created_at).label("latest"))
    .where(Call.episode_id == Episode.id, Call.created_at >= Episode.created_at - literal(CALL_CLOCK_SLACK))
    .lateral()
)
_LAST_PARTITIONED = (
    select(Episode.id, _SINCE_START.c.position, _SINCE_START.c.latest)
    .join(_SINCE_START, true())
    .where(Episode.id.in_(bindparam("episodes", expanding=True)), _SINCE_START.c.position.is_not(None))
)
# PostgreSQL: writers of several replicas adding to one episode take its row in turn (in id order: no deadlock),
# so no two of them number their calls from the same last position.
_LOCK_EPISODES = (
    select(Episode.id)
    .where(Episode.id.in_(bindparam("episodes", expanding=True)))
    .order_by(Episode.id)
    .with_for_update()
)
_EPISODE_CALLS = select(Call.id, Call.episode_id, Call.position, Call.created_at).where(
    Call.episode_id.in_(bindparam("episodes", expanding=True))
)
_CALLS = cast(Table, Call.__table__)
_MOVE = (
    update(_CALLS).where(_CALLS.c.id == bindparam("moved_id")).values(position=bindparam("moved_position"))
)
_TARGET = select(Call.id, Call.episode_id, Call.policy, Episode.project).join(
    Episode, Episode.id == Call.episode_id
)
_BY_ID = _TARGET.where(Call.id == bindparam("id"))
_BY_CLIENT_ID = (
    _TARGET.where(Call.client_request_id == bindparam("id")).order_by(Call.created_at.desc()).limit(1)
)


def _json_text(value: Any) -> str | None:
    """A JSON column's text; a value still in its logged JSON form (`msgspec.Raw`) is used as it is, and its
    `null` is stored as SQL NULL, as None is."""
    if isinstance(value, msgspec.Raw):
        text = bytes(value).decode()
        return None if text == "null" else text
    return msgspec.json.encode(value).decode()


def _sqlite_datetime(value: datetime) -> str:
    """SQLAlchemy's SQLite DateTime storage format (UTC, as given); isoformat is several times cheaper than
    strftime, which showed up in the writer's profile."""
    return value.replace(tzinfo=None).isoformat(" ", "microseconds")


def _converters(model: type[Base], dialect: str) -> dict[str, Callable[[Any], Any]]:
    """Per column, what turns a Python value into what the DBAPI driver takes (the ORM's type processing,
    done once per value, and only for the columns that need it)."""
    converters: dict[str, Callable[[Any], Any]] = {}
    for name, column in model.__table__.columns.items():
        if isinstance(column.type, JSON):
            converters[name] = _json_text
        elif dialect == "sqlite" and isinstance(column.type, DateTime):
            converters[name] = _sqlite_datetime
    return converters


# Bound parameters one SQLite statement may hold (the default limit since SQLite 3.32; 999 before).
_SQLITE_MAX_VARIABLES = 32766 if sqlite3.sqlite_version_info >= (3, 32, 0) else 999

_CONVERTERS = {
    (model.__tablename__, dialect): _converters(model, dialect)
    for model in (Call, Episode, StitchKey, StoredResponse)
    for dialect in ("sqlite", "postgresql")
}


def _driver_params(model: type[Base], dialect: str, rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Rows as the DBAPI driver takes them: the ORM's type processing, done once per value, and only for the
    columns that need it. Every row is built with the same keys in the same order."""
    converters = _CONVERTERS[(model.__tablename__, dialect)]
    convert = [(index, converters[c]) for index, c in enumerate(rows[0]) if c in converters]
    params: list[tuple[Any, ...]] = []
    for row in rows:
        values = list(row.values())
        for index, converter in convert:
            value = values[index]
            if value is not None:
                values[index] = converter(value)
        params.append(tuple(values))
    return params


async def _insert_many(
    connection: AsyncConnection, model: type[Base], rows: list[dict[str, Any]], conflict: str
) -> None:
    """INSERT ... ON CONFLICT straight through the driver, skipping SQLAlchemy's per-row compilation.

    This is the capture writer's hot loop: per row it costs about a quarter of the Core executemany path
    (measured: 26 vs ~100 us of CPU per call row on SQLite). On SQLite the rows go as multi-row VALUES
    statements: one step per statement instead of executemany's one per row.
    """
    if not rows:
        return
    dialect = connection.dialect
    columns = list(rows[0])
    if dialect.paramstyle == "qmark":
        marks = ", ".join("?" for _ in columns)
    elif dialect.paramstyle == "numeric_dollar":
        marks = ", ".join(f"${i}" for i in range(1, len(columns) + 1))
    else:
        marks = ", ".join("%s" for _ in columns)
    quoted = ", ".join(dialect.identifier_preparer.quote(c) for c in columns)
    params = _driver_params(model, dialect.name, rows)
    if dialect.name != "sqlite":
        sql = f"INSERT INTO {model.__tablename__} ({quoted}) VALUES ({marks}) ON CONFLICT {conflict}"
        await connection.exec_driver_sql(sql, params)
        return
    per_statement = max(1, _SQLITE_MAX_VARIABLES // len(columns))
    for start in range(0, len(params), per_statement):
        chunk = params[start : start + per_statement]
        rows_sql = ", ".join([f"({marks})"] * len(chunk))
        await connection.exec_driver_sql(
            f"INSERT INTO {model.__tablename__} ({quoted}) VALUES {rows_sql} ON CONFLICT {conflict}",
            tuple(chain.from_iterable(chunk)),
        )


async def _copy_new(connection: AsyncConnection, model: type[Base], rows: list[dict[str, Any]]) -> None:
    """PostgreSQL: rows whose keys this transaction found unstored go in by binary COPY, which costs the
    server far less per row than an INSERT per row. A key stored meanwhile by someone else fails the COPY
    with a unique violation; the capture writer then retries record by record, and those skip stored ids."""
    raw = await connection.get_raw_connection()
    driver = raw.driver_connection
    assert driver is not None
    params = _driver_params(model, "postgresql", rows)
    try:
        await driver.copy_records_to_table(model.__tablename__, records=params, columns=list(rows[0]))
    except asyncpg.PostgresError as exc:  # refused by the server: the same outcome as a refused INSERT
        raise DBAPIError(f"COPY {model.__tablename__}", None, exc) from exc
    except asyncpg.InterfaceError as exc:  # the connection is gone
        raise OperationalError(f"COPY {model.__tablename__}", None, exc, connection_invalidated=True) from exc


async def resolve_stitched_episodes(
    session: AsyncSession, records: Sequence[CallRecord], *, hold_after: float | None = None
) -> list[CallRecord]:
    """Give records that the gateway could not stitch from memory the episode of a stored earlier call.

    With `hold_after` (a unix time), a record created after it whose earlier turn is not stored yet is not
    settled but returned, to be tried again: behind a load balancer that turn may have been answered by another
    replica whose writer has not committed it yet. Later records of the same conversation are held with it.
    Every other record is settled (a miss starts a new episode under the record's provisional id).
    """
    pending = [r for r in records if not r.episode_resolved and r.stitch_lookup]
    if not pending:
        for record in records:
            record.episode_resolved = True
        return []
    wanted = {h for r in pending for h in r.stitch_lookup}
    rows = await session.execute(_STITCHED, {"hashes": list(wanted)})
    found = {h: e for h, e in rows}
    held: list[CallRecord] = []
    # Earlier records of this very batch count too (a conversation's turns can share a batch).
    for record in records:
        if not record.episode_resolved:
            hit = next((found[c] for c in record.stitch_lookup if c in found), None)
            if hit is not None:
                record.episode_id = hit
            elif record.stitch_lookup and hold_after is not None and record.created_at > hold_after:
                held.append(record)
                continue
            record.episode_resolved = True
        for key in record.stitch_keys:
            found[key] = record.episode_id
    return held


async def write_calls(session: AsyncSession, records: Sequence[CallRecord]) -> int:
    """Insert a batch of calls with their episodes and stitch keys in one transaction; returns rows inserted."""
    if not records:
        return 0
    await resolve_stitched_episodes(session, records)
    unique = list({r.id: r for r in reversed(records)}.values())[::-1]  # first occurrence of an id wins
    times = [r.created_at for r in unique]
    postgres = session.get_bind().dialect.name == "postgresql"
    known = await session.execute(
        _KNOWN_IN_SPAN if postgres else _KNOWN,
        {
            "ids": [r.id for r in unique],
            "episodes": list({r.episode_id for r in unique}),
            "since": datetime.fromtimestamp(min(times), UTC),
            "until": datetime.fromtimestamp(max(times), UTC),
        },
    )
    existing: set[str] = set()
    owner: dict[str, str] = {}
    for stored, key, project in known:
        if stored:
            existing.add(key)
        else:
            owner[key] = project
    fresh = [r for r in unique if r.id not in existing]
    if not fresh:
        return 0
    _keep_projects_apart(fresh, owner)

    episodes: dict[str, dict[str, Any]] = {}
    for r in fresh:
        ts = datetime.fromtimestamp(r.created_at, UTC)
        episodes.setdefault(
            r.episode_id,
            {
                "id": r.episode_id,
                "policy": r.policy,
                "group_key": r.group_key,
                "project": r.project,
                "source": r.source,
                "metadata": r.episode_metadata,
                "tags": [],
                "created_at": ts,
                "updated_at": ts,
            },
        )
    connection = await session.connection()
    await _insert_many(connection, Episode, list(episodes.values()), conflict="DO NOTHING")
    positions = await _positions(session, fresh, postgres=connection.dialect.name == "postgresql")

    call_rows = []
    for r in fresh:
        usage = r.usage or {}
        call_rows.append(
            {
                "id": r.id,
                "client_request_id": r.client_request_id,
                "episode_id": r.episode_id,
                "position": positions[r.id],
                "policy": r.policy,
                "model": r.model,
                "adapter_version": r.adapter_version,
                "engine_model": r.engine_model,
                "stream": r.stream,
                "request": r.request,
                "response": r.response,
                "prompt_token_ids": r.prompt_token_ids,
                "completion_token_ids": r.completion_token_ids,
                "completion_logprobs": r.completion_logprobs,
                "usage": r.usage,
                "prompt_tokens": usage.get("prompt_tokens"),
                "completion_tokens": usage.get("completion_tokens"),
                "latency_ms": r.latency_ms,
                "ttft_ms": r.ttft_ms,
                "status": r.status,
                "error": r.error,
                "context_hash": r.context_hash,
                "group_key": r.group_key,
                "user": r.user,
                "key_id": r.key_id,
                "created_at": datetime.fromtimestamp(r.created_at, UTC),
            }
        )
    if connection.dialect.name == "postgresql":
        await _copy_new(connection, Call, call_rows)
    else:
        await _insert_many(connection, Call, call_rows, conflict="DO NOTHING")
    # Calls stamped long ago (the capture log replayed after an outage, an import) may fall in buckets the
    # dashboard's rollup already summed; fresh calls cost one comparison each here.
    await mark_changed(session, [datetime.fromtimestamp(r.created_at, UTC) for r in fresh])
    now = datetime.now(UTC)
    keys = [
        {"hash": key, "episode_id": r.episode_id, "created_at": now} for r in fresh for key in r.stitch_keys
    ]
    if keys:
        # The latest conversation with a given tail wins: it is the one a follow-up most likely continues.
        await _insert_many(
            connection, StitchKey, keys, conflict="(hash) DO UPDATE SET episode_id = excluded.episode_id"
        )
    await _insert_many(connection, StoredResponse, _response_rows(fresh), conflict="DO NOTHING")
    await session.commit()
    return len(call_rows)


def _response_rows(records: Sequence[CallRecord]) -> list[dict[str, Any]]:
    """Rows of `responses` for the `/v1/responses` calls of a batch that asked to be stored."""
    return [
        {
            "id": stored.id,
            "call_id": r.id,
            "previous_response_id": stored.previous_response_id,
            "body": stored.body,
            "input_items": stored.input_items,
            "created_at": datetime.fromtimestamp(r.created_at, UTC),
        }
        for r in records
        if (stored := r.stored_response) is not None
    ]


def _utc(value: datetime) -> datetime:
    """SQLite hands back naive datetimes; they were written in UTC."""
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


async def _positions(session: AsyncSession, fresh: Sequence[CallRecord], *, postgres: bool) -> dict[str, int]:
    """Each new call's position in its episode: after the stored ones, in the order the calls were made.

    A call made before one that is stored already (its turn was held back, or another replica's writer was
    faster) is slotted in by time, and the stored calls after it move one down. On PostgreSQL the episodes'
    rows are locked first, so writers of several replicas number one episode's calls one after the other.
    """
    episode_ids = sorted({r.episode_id for r in fresh})
    if postgres:
        await session.execute(_LOCK_EPISODES, {"episodes": episode_ids})
    rows = await session.execute(_LAST_PARTITIONED if postgres else _LAST, {"episodes": episode_ids})
    last = {episode: (position, _utc(latest)) for episode, position, latest in rows}
    ordered = sorted(fresh, key=lambda r: r.created_at)
    late = {
        r.episode_id
        for r in ordered
        if r.episode_id in last and datetime.fromtimestamp(r.created_at, UTC) < last[r.episode_id][1]
    }
    positions: dict[str, int] = {}
    next_position = {episode: position + 1 for episode, (position, _) in last.items() if episode not in late}
    for r in ordered:
        if r.episode_id not in late:
            positions[r.id] = next_position.get(r.episode_id, 0)
            next_position[r.episode_id] = positions[r.id] + 1
    if late:
        # (time, call id, its stored position or None for a new call)
        timeline: dict[str, list[tuple[datetime, str, int | None]]] = defaultdict(list)
        rows = await session.execute(_EPISODE_CALLS, {"episodes": sorted(late)})
        for call_id, episode, was, created in rows:
            timeline[episode].append((_utc(created), call_id, was))
        for r in ordered:
            if r.episode_id in late:
                timeline[r.episode_id].append((datetime.fromtimestamp(r.created_at, UTC), r.id, None))
        moved = []
        for calls in timeline.values():
            calls.sort(key=lambda c: (c[0], c[1]))
            for slot, (_, call_id, stored) in enumerate(calls):
                if stored is None:
                    positions[call_id] = slot
                elif stored != slot:
                    moved.append({"moved_id": call_id, "moved_position": slot})
        if moved:
            await session.execute(_MOVE, moved)
    return positions


def _keep_projects_apart(records: Sequence[CallRecord], owner: dict[str, str]) -> None:
    """A call that names (`x-episode-id`) an episode of another project starts an episode of its own, named
    after the call: a key never adds turns to a conversation it cannot read. `owner`: the stored episodes'
    projects."""
    for record in records:  # earlier records of the batch create episodes too
        project = owner.setdefault(record.episode_id, record.project)
        if project != record.project:
            record.episode_id = record.id
            owner[record.id] = record.project


async def find_call(session: AsyncSession, request_id: str) -> tuple[str, str, str | None, str] | None:
    """(call id, episode id, policy, project) of the call a request id names: the call with that server id,
    else the newest call whose client sent it as its own `x-request-id`; None when neither is stored (yet)."""
    row = (await session.execute(_BY_ID, {"id": request_id})).first()
    if row is None:
        row = (await session.execute(_BY_CLIENT_ID, {"id": request_id})).first()
    return None if row is None else (row[0], row[1], row[2], row[3])


async def find_stitched_episode(session: AsyncSession, lookup: Sequence[str]) -> tuple[str, str] | None:
    """(tail hash, episode id) of the longest of `lookup`'s conversation tails (longest first) that a stored call
    registered; None when none did."""
    if not lookup:
        return None
    found = {h: e for h, e in await session.execute(_STITCHED, {"hashes": list(lookup)})}
    return next(((h, found[h]) for h in lookup if h in found), None)


async def recent_stitch_keys(session: AsyncSession, limit: int) -> list[tuple[str, str]]:
    """The newest conversation tails, oldest first, to warm the gateway's stitch cache at start-up."""
    rows = await session.execute(
        select(StitchKey.hash, StitchKey.episode_id).order_by(StitchKey.created_at.desc()).limit(limit)
    )
    return [(h, e) for h, e in rows][::-1]
