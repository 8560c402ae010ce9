"""Repository functions for captured calls and their episodes.

`write_calls` is idempotent (a call id is written at most once), so a batch may be replayed from the spool after
a failure whose outcome was unknown without creating duplicates.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession

from storage.models import Call, Episode, StitchKey
from storage.records import CallRecord


def _insert(session: AsyncSession, model: type[Any]) -> Any:
    """A dialect-specific INSERT that supports ON CONFLICT."""
    if session.get_bind().dialect.name == "postgresql":
        return postgresql.insert(model)
    return sqlite.insert(model)


async def resolve_stitched_episodes(session: AsyncSession, records: Sequence[CallRecord]) -> None:
    """Give records that the gateway could not stitch from memory the episode of a stored earlier call."""
    pending = [r for r in records if not r.episode_resolved and r.stitch_lookup]
    if not pending:
        return
    wanted = {h for r in pending for h in r.stitch_lookup}
    rows = await session.execute(
        select(StitchKey.hash, StitchKey.episode_id).where(StitchKey.hash.in_(wanted))
    )
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
    ids = [r.id for r in unique]
    existing = set((await session.execute(select(Call.id).where(Call.id.in_(ids)))).scalars().all())
    fresh = [r for r in unique if r.id not in existing]
    if not fresh:
        return 0

    episodes: dict[str, dict[str, Any]] = {}
    for r in fresh:
        ts = datetime.fromtimestamp(r.created_at, UTC)
        episodes.setdefault(
            r.episode_id,
            {
                "id": r.episode_id,
                "policy": r.policy,
                "group_key": r.group_key,
                "meta": r.episode_metadata,
                "tags": [],
                "created_at": ts,
                "updated_at": ts,
            },
        )
    await session.execute(_insert(session, Episode).values(list(episodes.values())).on_conflict_do_nothing())

    next_position: dict[str, int] = defaultdict(int)
    rows = await session.execute(
        select(Call.episode_id, func.max(Call.position))
        .where(Call.episode_id.in_(list(episodes)))
        .group_by(Call.episode_id)
    )
    for episode_id, position in rows:
        next_position[episode_id] = position + 1

    call_rows = []
    for r in sorted(fresh, key=lambda rec: rec.created_at):
        position = next_position[r.episode_id]
        next_position[r.episode_id] = position + 1
        usage = r.usage or {}
        call_rows.append(
            {
                "id": r.id,
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
                "created_at": datetime.fromtimestamp(r.created_at, UTC),
            }
        )
    await session.execute(_insert(session, Call).values(call_rows).on_conflict_do_nothing())

    keys = {key: r.episode_id for r in fresh for key in r.stitch_keys}
    if keys:
        stmt = _insert(session, StitchKey).values(
            [{"hash": h, "episode_id": e, "created_at": datetime.now(UTC)} for h, e in keys.items()]
        )
        # The latest conversation with a given tail wins: it is the one a follow-up most likely continues.
        stmt = stmt.on_conflict_do_update(
            index_elements=["hash"], set_={"episode_id": stmt.excluded.episode_id}
        )
        await session.execute(stmt)
    await session.commit()
    return len(call_rows)


async def recent_stitch_keys(session: AsyncSession, limit: int) -> list[tuple[str, str]]:
    """The newest conversation tails, oldest first, to warm the gateway's stitch cache at start-up."""
    rows = await session.execute(
        select(StitchKey.hash, StitchKey.episode_id).order_by(StitchKey.created_at.desc()).limit(limit)
    )
    return [(h, e) for h, e in rows][::-1]
