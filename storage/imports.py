"""Storing conversations that did not come through the gateway (an import) as episodes of their own source.

Each conversation arrives as one call record whose request holds the messages before the final reply and whose
response holds that reply, so everything that reads trajectories (the API, export, judging, training) sees the
conversation itself. The episode rows are inserted first with their `source`; the calls go through the capture
writer's own `write_calls`, so an imported call is stored exactly as a captured one would be.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from storage.calls import write_calls
from storage.dialect import insert
from storage.models import Episode
from storage.records import CallRecord


async def stored_episode_ids(session: AsyncSession, episode_ids: Sequence[str]) -> set[str]:
    if not episode_ids:
        return set()
    rows = await session.scalars(select(Episode.id).where(Episode.id.in_(list(episode_ids))))
    return set(rows)


async def store_conversations(session: AsyncSession, records: Sequence[CallRecord], source: str) -> int:
    """Insert conversations (one call record each) as episodes of `source`; ones already stored are left as
    they are (the ids decide), so storing the same batch twice writes nothing the second time. Commits.
    Returns the calls inserted."""
    if not records:
        return 0
    episodes: list[dict[str, Any]] = [
        {
            "id": r.episode_id,
            "policy": r.policy,
            "group_key": r.group_key,
            "project": r.project,
            "source": source,
            "meta": r.episode_metadata,
            "tags": [],
            "created_at": datetime.fromtimestamp(r.created_at, UTC),
            "updated_at": datetime.fromtimestamp(r.created_at, UTC),
        }
        for r in records
    ]
    await session.execute(
        insert(session, Episode).values(episodes).on_conflict_do_nothing(index_elements=["id"])
    )
    return await write_calls(session, records)
