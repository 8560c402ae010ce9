"""Repository functions for rewards: idempotent inserts, the signals of episodes, and late linking.

A reward names a call or an episode by id without a foreign key, because feedback may arrive before the
capture writer stores its target. Such a reward is `pending`; `link_pending` attaches it once the target
exists (a call's reward learns its episode), and `mark_orphans` flags those whose target never appeared.
An orphan is still linked if its target shows up later (for example after a long database outage).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from storage.dialect import insert
from storage.models import Call, Episode, JudgeGroup, Reward
from storage.rollups import mark_changed


@dataclass(frozen=True)
class RewardInfo:
    id: int
    call_id: str | None
    episode_id: str | None
    source: str
    name: str
    value: float
    label: str | None
    comment: str | None
    metadata: dict[str, Any]
    idempotency_key: str | None
    status: str
    created_at: datetime


@dataclass
class NewReward:
    source: str
    value: float
    call_id: str | None = None
    episode_id: str | None = None
    name: str = "user"
    label: str | None = None
    comment: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    idempotency_key: str | None = None
    status: str = "linked"
    key_id: str | None = None  # the API key that sent it
    project: str | None = None  # the sender's project, when it is confined to one


def _info(row: Reward) -> RewardInfo:
    return RewardInfo(
        row.id,
        row.call_id,
        row.episode_id,
        row.source,
        row.name,
        row.value,
        row.label,
        row.comment,
        dict(row.meta or {}),
        row.idempotency_key,
        row.status,
        row.created_at,
    )


async def rewards_by_key(session: AsyncSession, keys: Sequence[str]) -> dict[str, RewardInfo]:
    if not keys:
        return {}
    rows = (await session.execute(select(Reward).where(Reward.idempotency_key.in_(list(keys))))).scalars()
    return {row.idempotency_key: _info(row) for row in rows if row.idempotency_key is not None}


async def insert_rewards(
    session: AsyncSession, rewards: Sequence[NewReward]
) -> list[tuple[RewardInfo, bool]]:
    """Insert rewards; one whose idempotency key exists is not inserted and the stored one is returned.

    Returns (reward, inserted) per input, in order. Safe under concurrency: the unique key decides.
    """
    out: list[tuple[RewardInfo, bool]] = []
    for reward in rewards:
        stmt = (
            insert(session, Reward)
            .values(
                call_id=reward.call_id,
                episode_id=reward.episode_id,
                source=reward.source,
                name=reward.name,
                value=reward.value,
                label=reward.label,
                comment=reward.comment,
                meta=reward.metadata,
                idempotency_key=reward.idempotency_key,
                status=reward.status,
                key_id=reward.key_id,
                project=reward.project,
                created_at=datetime.now(UTC),
            )
            .on_conflict_do_nothing(index_elements=["idempotency_key"])
            .returning(Reward.id)
        )
        new_id = (await session.execute(stmt)).scalar_one_or_none()
        if new_id is None:
            existing = await rewards_by_key(session, [reward.idempotency_key or ""])
            out.append((existing[reward.idempotency_key or ""], False))
            continue
        row = await session.get(Reward, new_id)
        assert row is not None
        out.append((_info(row), True))
    return out


async def rewards_for_episodes(
    session: AsyncSession, episode_ids: Sequence[str]
) -> dict[str, list[RewardInfo]]:
    """Every linked reward of these episodes: those naming the episode and those naming one of its calls."""
    if not episode_ids:
        return {}
    ids = list(episode_ids)
    call_ids = select(Call.id).where(Call.episode_id.in_(ids))
    rows = (
        (
            await session.execute(
                select(Reward)
                .where(or_(Reward.episode_id.in_(ids), Reward.call_id.in_(call_ids)))
                .order_by(Reward.created_at, Reward.id)
            )
        )
        .scalars()
        .all()
    )
    owners = await session.execute(select(Episode.id, Episode.project).where(Episode.id.in_(ids)))
    projects = {episode_id: project for episode_id, project in owners}
    episode_of_call: dict[str, str] = {}
    if any(r.episode_id is None for r in rows):
        # A pending reward names only its call; iterate the rows (a `Result` is not a mapping for dict()).
        pairs = await session.execute(select(Call.id, Call.episode_id).where(Call.episode_id.in_(ids)))
        episode_of_call = {call_id: episode_id for call_id, episode_id in pairs}
    result: dict[str, list[RewardInfo]] = {episode_id: [] for episode_id in ids}
    for row in rows:
        episode_id = row.episode_id or episode_of_call.get(row.call_id or "")
        if row.project is not None and row.project != projects.get(episode_id or ""):
            continue  # early feedback from another project that named this episode: never its reward
        if episode_id in result:
            result[episode_id].append(_info(row))
    return result


async def oldest_unlinked(
    session: AsyncSession, *, call_id: str | None = None, episode_id: str | None = None
) -> datetime | None:
    """When the first still-unlinked reward for this target arrived (None when there is none)."""
    query = select(func.min(Reward.created_at)).where(Reward.status != "linked")
    if call_id is not None:
        query = query.where(Reward.call_id == call_id)
    else:
        query = query.where(Reward.episode_id == episode_id, Reward.call_id.is_(None))
    oldest: datetime | None = await session.scalar(query)
    # SQLite hands timestamps back without their zone; every timestamp Kaizen writes is UTC.
    return oldest.replace(tzinfo=UTC) if oldest is not None and oldest.tzinfo is None else oldest


async def link_pending(session: AsyncSession) -> set[str]:
    """Link unlinked rewards whose call or episode is now stored; returns the episodes that gained rewards."""
    touched: set[str] = set()
    arrived: list[datetime] = []  # when each linked reward arrived: the rollup counts feedback by it
    # Feedback from a key confined to a project links only to that project's calls and episodes.
    same_project = or_(Reward.project.is_(None), Reward.project == Episode.project)
    by_call = await session.execute(
        select(Reward.id, Call.episode_id, Reward.created_at)
        .join(Call, Call.id == Reward.call_id)
        .join(Episode, Episode.id == Call.episode_id)
        .where(Reward.status != "linked", Reward.call_id.is_not(None), same_project)
    )
    for reward_id, episode_id, created_at in by_call:
        await session.execute(
            update(Reward).where(Reward.id == reward_id).values(episode_id=episode_id, status="linked")
        )
        touched.add(episode_id)
        arrived.append(created_at)
    # Early feedback may name a client's own request id: it goes to the newest call that carried it.
    by_client_id = await session.execute(
        select(Reward.id, Call.id, Call.episode_id, Reward.created_at)
        .join(Call, Call.client_request_id == Reward.call_id)
        .join(Episode, Episode.id == Call.episode_id)
        .where(Reward.status != "linked", Reward.call_id.is_not(None), same_project)
        .order_by(Call.created_at)
    )
    newest = {
        reward_id: (call_id, episode_id, created_at)
        for reward_id, call_id, episode_id, created_at in by_client_id
    }
    for reward_id, (call_id, episode_id, created_at) in newest.items():
        await session.execute(
            update(Reward)
            .where(Reward.id == reward_id)
            .values(call_id=call_id, episode_id=episode_id, status="linked")
        )
        touched.add(episode_id)
        arrived.append(created_at)
    by_episode = await session.execute(
        select(Reward.id, Episode.id, Reward.created_at)
        .join(Episode, Episode.id == Reward.episode_id)
        .where(Reward.status != "linked", Reward.call_id.is_(None), same_project)
    )
    for reward_id, episode_id, created_at in by_episode:
        await session.execute(update(Reward).where(Reward.id == reward_id).values(status="linked"))
        touched.add(episode_id)
        arrived.append(created_at)
    await mark_changed(session, arrived)
    return touched


async def mark_orphans(session: AsyncSession, older_than: datetime) -> int:
    """Flag pending rewards that arrived before `older_than` and whose target is still unknown."""
    result = await session.execute(
        update(Reward)
        .where(Reward.status == "pending", Reward.created_at < older_than)
        .values(status="orphaned")
    )
    return int(result.rowcount)  # type: ignore[attr-defined]


async def record_judge_group(
    session: AsyncSession,
    *,
    policy: str | None,
    group_key: str,
    episode_ids: list[str],
    scorer: str,
    model: str | None,
    status: str,
    attempts: int,
    error: str | None,
    latency_ms: float | None,
    cost_usd: float | None,
) -> int:
    row = JudgeGroup(
        policy=policy,
        group_key=group_key[:256],
        episode_ids=episode_ids,
        scorer=scorer,
        model=model,
        status=status,
        attempts=attempts,
        error=error,
        latency_ms=latency_ms,
        cost_usd=cost_usd,
    )
    session.add(row)
    await session.flush()
    return row.id
