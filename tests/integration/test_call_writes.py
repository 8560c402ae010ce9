"""The capture writer's SQL on SQLite and PostgreSQL: batches stored once by call id, in episode order, with the
bulk paths (multi-row VALUES on SQLite, COPY on PostgreSQL) storing exactly what was captured."""

from __future__ import annotations

import asyncio
import time
import uuid

import msgspec
import pytest
from sqlalchemy import select, text
from sqlalchemy.exc import DBAPIError

from gateway.settings import async_database_url
from migrations.runner import upgrade_database
from storage.calls import _copy_new, write_calls
from storage.database import Database
from storage.models import Call, Episode
from storage.records import CallRecord, LoggedCall
from tests.support.postgres import PostgresServer


def record(call_id: str, episode_id: str, created_at: float) -> CallRecord:
    return CallRecord(
        id=call_id,
        episode_id=episode_id,
        episode_resolved=True,
        stitch_keys=[f"key-{call_id}"],
        policy="p",
        model="p",
        request={"messages": [{"role": "user", "content": f"hi {call_id}"}]},
        response={"choices": [{"message": {"role": "assistant", "content": "yo"}}]},
        prompt_token_ids=[1, 2],
        completion_token_ids=[[3, 2]],
        completion_logprobs=[[-0.5, -0.125]],
        usage={"prompt_tokens": 2, "completion_tokens": 2},
        created_at=created_at,
    )


def test_a_replayed_batch_is_stored_once_and_positions_continue(database_url: str) -> None:
    url = async_database_url(database_url)
    start = time.time()
    # More rows than one SQLite statement holds, so the multi-row INSERT is split.
    first = [record(f"c{n}", f"e{n % 7}", start + n) for n in range(1500)]
    replay = [*first[-3:], record("late-a", "e1", start + 2000), record("late-b", "new", start + 2001)]

    async def scenario() -> None:
        await upgrade_database(url)
        db = Database(url)
        try:
            async with db.session() as session:
                assert await write_calls(session, first) == 1500
            async with db.session() as session:
                assert await write_calls(session, replay) == 2
            async with db.session() as session:
                rows = (await session.execute(select(Call).order_by(Call.created_at))).scalars().all()
                episodes = set((await session.execute(select(Episode.id))).scalars().all())
        finally:
            await db.dispose()
        assert [r.id for r in rows] == [r.id for r in first] + ["late-a", "late-b"]
        assert episodes == {f"e{n}" for n in range(7)} | {"new"}
        positions: dict[str, list[int]] = {}
        for row in rows:
            positions.setdefault(row.episode_id, []).append(row.position)
        assert all(p == list(range(len(p))) for p in positions.values())
        late = rows[-2]
        assert (late.episode_id, late.position) == ("e1", len(positions["e1"]) - 1)
        assert late.request == {"messages": [{"role": "user", "content": "hi late-a"}]}
        assert late.completion_logprobs == [[-0.5, -0.125]]
        assert (late.prompt_tokens, late.completion_tokens) == (2, 2)
        assert abs(late.created_at.timestamp() - (start + 2000)) < 1e-3

    asyncio.run(scenario())


def test_copy_of_a_stored_id_is_refused_as_a_database_error(postgres: PostgresServer) -> None:
    """Should a call id be stored between the batch's check and its COPY (the PostgreSQL path), the COPY fails
    the way a refused INSERT does (a DBAPIError), so the capture writer retries record by record instead of
    losing the batch."""
    url = async_database_url(postgres.create_database("t_" + uuid.uuid4().hex[:12]))

    async def scenario() -> None:
        await upgrade_database(url)
        db = Database(url)
        try:
            async with db.session() as session:
                await write_calls(session, [record("taken", "e", time.time())])
            async with db.session() as session:
                stored = (await session.execute(select(Call).where(Call.id == "taken"))).scalar_one()
                row = {c.key: getattr(stored, c.key) for c in Call.__table__.columns}
                connection = await session.connection()
                with pytest.raises(DBAPIError):
                    await _copy_new(connection, Call, [row])
        finally:
            await db.dispose()

    asyncio.run(scenario())


def test_a_call_read_back_from_the_log_is_stored_as_its_record(database_url: str) -> None:
    """The writer keeps the JSON-only fields of a logged line as their raw bytes (`LoggedCall`): stored, they
    read back exactly as the record's values, JSON null as SQL NULL and NUL characters included."""
    url = async_database_url(database_url)
    full = record("full", "e-full", time.time())
    full.request["messages"][0]["content"] = "a\u0000b é ✓"
    full.error = {"status": 502, "message": "upstream", "code": None}
    bare = CallRecord(
        id="bare", episode_id="e-bare", episode_resolved=True, model="p", request={}, created_at=1.0
    )
    logged = [msgspec.json.decode(msgspec.json.encode(r), type=LoggedCall) for r in (full, bare)]
    assert isinstance(logged[0].request, msgspec.Raw)

    async def scenario() -> None:
        await upgrade_database(url)
        db = Database(url)
        try:
            async with db.session() as session:
                assert await write_calls(session, logged) == 2
            async with db.session() as session:
                rows = {c.id: c for c in (await session.execute(select(Call))).scalars()}
                sql_null = await session.execute(
                    text("SELECT id FROM calls WHERE response IS NULL AND error IS NULL")
                )
        finally:
            await db.dispose()
        for original in (full, bare):
            row = rows[original.id]
            for field in (
                "request",
                "response",
                "prompt_token_ids",
                "completion_token_ids",
                "completion_logprobs",
            ):
                assert getattr(row, field) == getattr(original, field), field
            assert row.error == original.error and row.usage == original.usage
        assert [row.id for row in sql_null] == ["bare"]  # SQL NULL, not the JSON text `null`

    asyncio.run(scenario())
