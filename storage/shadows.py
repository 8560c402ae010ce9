"""Shadow pairs: calls a shadow rollout's candidate answered beside the serving version, and their scores.

A gateway stores a pair per copied call (`gateway.shadow`); the canary monitor scores the unscored ones with the
policy's scorer (`trainer.control.shadow_scoring`) and decides on the paired differences. A pair whose scoring
failed is marked scored with no rewards, so it is not tried again and counts for nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from storage.models import ShadowPair


@dataclass(frozen=True)
class NewPair:
    """A pair as the gateway stores it: the context both versions answered and both replies, already redacted."""

    rollout_id: int
    call_id: str
    messages: list[Any]
    served: dict[str, Any]
    shadow: dict[str, Any]
    created_at: datetime


@dataclass(frozen=True)
class PairInfo:
    id: int
    rollout_id: int
    call_id: str
    messages: list[Any]
    served: dict[str, Any]
    shadow: dict[str, Any]
    created_at: datetime


async def add_pairs(session: AsyncSession, pairs: Sequence[NewPair]) -> None:
    """Insert pairs in one statement (not committed)."""
    if not pairs:
        return
    await session.execute(
        insert(ShadowPair),
        [
            {
                "rollout_id": p.rollout_id,
                "call_id": p.call_id,
                "messages": p.messages,
                "served": p.served,
                "shadow": p.shadow,
                "created_at": p.created_at,
            }
            for p in pairs
        ],
    )


async def unscored_pairs(session: AsyncSession, rollout_id: int, limit: int) -> list[PairInfo]:
    """The rollout's oldest pairs not scored yet."""
    rows = await session.execute(
        select(ShadowPair)
        .where(ShadowPair.rollout_id == rollout_id, ShadowPair.scored_at.is_(None))
        .order_by(ShadowPair.id)
        .limit(limit)
    )
    return [
        PairInfo(
            p.id, p.rollout_id, p.call_id, list(p.messages), dict(p.served), dict(p.shadow), p.created_at
        )
        for p in rows.scalars()
    ]


async def set_scores(session: AsyncSession, scores: Sequence[tuple[int, float | None, float | None]]) -> None:
    """Record `(pair id, served reward, shadow reward)`; a None reward marks a pair whose scoring failed."""
    now = datetime.now(UTC)
    for pair_id, served, shadow in scores:
        await session.execute(
            update(ShadowPair)
            .where(ShadowPair.id == pair_id)
            .values(served_reward=served, shadow_reward=shadow, scored_at=now)
        )


async def paired_differences(session: AsyncSession, rollout_id: int) -> tuple[int, float, float]:
    """(pairs scored on both sides, mean of shadow - served reward, sample variance of those differences; 0.0
    below two pairs), summed in the database so the monitor reads three numbers whatever the rollout's size."""
    difference = ShadowPair.shadow_reward - ShadowPair.served_reward
    row = (
        await session.execute(
            select(func.count(), func.sum(difference), func.sum(difference * difference)).where(
                ShadowPair.rollout_id == rollout_id,
                ShadowPair.served_reward.is_not(None),
                ShadowPair.shadow_reward.is_not(None),
            )
        )
    ).one()
    n = int(row[0] or 0)
    if n == 0:
        return 0, 0.0, 0.0
    total, squares = float(row[1] or 0.0), float(row[2] or 0.0)
    mean = total / n
    if n < 2:
        return n, mean, 0.0
    # The sum-of-squares form can come out a hair below zero for equal differences.
    return n, mean, max(0.0, (squares - n * mean * mean) / (n - 1))
