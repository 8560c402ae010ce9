"""Repository functions for captured calls and their episodes.

`write_calls` is idempotent (a call id is written at most once), so a batch may be replayed from the spool after
a failure whose outcome was unknown without creating duplicates.
"""

from __future__ import annotations

import sqlite3
from collections import defaultdict
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from itertools import chain
from typing import Any

import asyncpg
import msgspec
from sqlalchemy import JSON, CompoundSelect, DateTime, bindparam, false, func, null, select, true, union_all
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from storage.models import Base, Call, Episode, StitchKey, StoredResponse
from storage.records import CallRecord

# Statements built once with expanding parameters: the capture writer runs them for every batch, and building
# an IN clause from a Python list costs per element.
_STITCHED = select(StitchKey.hash, StitchKey.episode_id).where(
    StitchKey.hash.in_(bindparam("hashes", expanding=True))
)
# One round trip for both things a batch needs to know: which of its call ids are stored already (position NULL),
# and the last stored position of each of its episodes. The writer's thread waits for the interpreter lock after
# every round trip while the serving thread is busy, so each one saved shortens a batch under load.
_KNOWN: CompoundSelect[Any] = union_all(
    select(true().label("stored"), Call.id, null().label("position")).where(
        Call.id.in_(bindparam("ids", expanding=True))
    ),
    select(false(), Call.episode_id, func.max(Call.position))
    .where(Call.episode_id.in_(bindparam("episodes", expanding=True)))
    .group_by(Call.episode_id),
)
_PROJECTS = select(Episode.id, Episode.project).where(Episode.id.in_(bindparam("episodes", expanding=True)))
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


async def resolve_stitched_episodes(session: AsyncSession, records: Sequence[CallRecord]) -> None:
    """Give records that the gateway could not stitch from memory the episode of a stored earlier call."""
    pending = [r for r in records if not r.episode_resolved and r.stitch_lookup]
    if not pending:
        return
    wanted = {h for r in pending for h in r.stitch_lookup}
    rows = await session.execute(_STITCHED, {"hashes": list(wanted)})
    found = {h: e for h, e in rows}
    # Earlier records of this very batch count too (a conversation's turns can share a batch).
    for record in records:
        if not record.episode_resolved:
            for candidate in record.stitch_lookup:
                if candidate in found:
                    record.episode_id = found[candidate]
                    break
            record.episode_resolved = True
        for key in record.stitch_keys:
            found[key] = record.episode_id


async def write_calls(session: AsyncSession, records: Sequence[CallRecord]) -> int:
    """Insert a batch of calls with their episodes and stitch keys in one transaction; returns rows inserted."""
    if not records:
        return 0
    await resolve_stitched_episodes(session, records)
    unique = list({r.id: r for r in reversed(records)}.values())[::-1]  # first occurrence of an id wins
    known = await session.execute(
        _KNOWN, {"ids": [r.id for r in unique], "episodes": list({r.episode_id for r in unique})}
    )
    existing: set[str] = set()
    next_position: dict[str, int] = defaultdict(int)
    for stored, key, position in known:
        if stored:
            existing.add(key)
        else:
            next_position[key] = position + 1
    fresh = [r for r in unique if r.id not in existing]
    if not fresh:
        return 0
    await _keep_projects_apart(session, fresh)

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

    call_rows = []
    for r in sorted(fresh, key=lambda rec: rec.created_at):
        position = next_position[r.episode_id]
        next_position[r.episode_id] = position + 1
        usage = r.usage or {}
        call_rows.append(
            {
                "id": r.id,
                "client_request_id": r.client_request_id,
                "episode_id": r.episode_id,
                "position": position,
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


async def _keep_projects_apart(session: AsyncSession, records: Sequence[CallRecord]) -> None:
    """A call that names (`x-episode-id`) an episode of another project starts an episode of its own, named
    after the call: a key never adds turns to a conversation it cannot read."""
    wanted = list({r.episode_id for r in records})
    rows = await session.execute(_PROJECTS, {"episodes": wanted})
    owner: dict[str, str] = {episode_id: project for episode_id, project in rows}
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


async def recent_stitch_keys(session: AsyncSession, limit: int) -> list[tuple[str, str]]:
    """The newest conversation tails, oldest first, to warm the gateway's stitch cache at start-up."""
    rows = await session.execute(
        select(StitchKey.hash, StitchKey.episode_id).order_by(StitchKey.created_at.desc()).limit(limit)
    )
    return [(h, e) for h, e in rows][::-1]
