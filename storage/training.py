"""Repository functions the trainer needs: rewarded episodes with their calls, and training runs.

Returns plain dataclasses so the trainer never holds ORM objects across its long, database-free training phase.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import aliased

from storage.models import Call, Episode, Reward, TrainingRun


@dataclass(frozen=True)
class EpisodeRow:
    """An episode of a policy with its training reward and how many reward signals back it."""

    id: str
    group_key: str | None
    meta: dict[str, Any]
    tags: list[Any]
    #: The episode's derived reward when set, else the mean of its (and its calls') reward rows.
    reward: float
    reward_count: int
    created_at: datetime


@dataclass(frozen=True)
class CallRow:
    """What the trainer reads of one call: the conversation and the tokens the engine sampled."""

    id: str
    episode_id: str
    position: int
    status: str
    request: dict[str, Any]
    response: dict[str, Any] | None
    prompt_token_ids: list[int] | None
    completion_token_ids: list[list[int] | None] | None
    completion_logprobs: list[list[float] | None] | None
    context_hash: str | None
    group_key: str | None
    adapter_version: int | None


async def rewarded_episodes(
    session: AsyncSession, policy: str, *, since: datetime | None, until: datetime
) -> list[EpisodeRow]:
    """Episodes of `policy` created in (since, until] that carry a reward, oldest first.

    A reward row counts for an episode when it names the episode or one of its calls. The episode's own
    `reward` column (derived by the policy's rule) wins over the plain mean of its reward rows.
    """
    owner = func.coalesce(Reward.episode_id, Call.episode_id)
    target = aliased(Episode)
    counts = (
        select(owner.label("episode_id"), func.avg(Reward.value).label("mean"), func.count().label("n"))
        .select_from(Reward)
        .outerjoin(Call, Reward.call_id == Call.id)
        .join(target, target.id == owner)
        # Early feedback from a key of another project never counts for an episode.
        .where(or_(Reward.project.is_(None), Reward.project == target.project))
        .group_by(owner)
        .subquery()
    )
    stmt = (
        select(Episode, counts.c.mean, counts.c.n)
        .outerjoin(counts, counts.c.episode_id == Episode.id)
        .where(Episode.policy == policy, Episode.created_at <= until)
        .where((Episode.reward.is_not(None)) | (counts.c.n > 0))
        .order_by(Episode.created_at, Episode.id)
    )
    if since is not None:
        stmt = stmt.where(Episode.created_at > since)
    rows = await session.execute(stmt)
    out = []
    for episode, mean, n in rows:
        reward = episode.reward if episode.reward is not None else float(mean)
        out.append(
            EpisodeRow(
                id=episode.id,
                group_key=episode.group_key,
                meta=dict(episode.meta or {}),
                tags=list(episode.tags or []),
                reward=float(reward),
                reward_count=int(n or 0),
                created_at=episode.created_at,
            )
        )
    return out


async def unrewarded_episodes(
    session: AsyncSession, policy: str, *, sources: Sequence[str], since: datetime | None, until: datetime
) -> list[EpisodeRow]:
    """Episodes of `policy` from `sources` (`episodes.source`) created in (since, until] that carry no reward
    at all (no derived reward, no reward row for them or their calls), oldest first; their `reward` is 0."""
    on_episode = select(Reward.id).where(Reward.episode_id == Episode.id)
    on_call = select(Reward.id).join(Call, Reward.call_id == Call.id).where(Call.episode_id == Episode.id)
    stmt = (
        select(Episode)
        .where(Episode.policy == policy, Episode.source.in_(list(sources)), Episode.created_at <= until)
        .where(Episode.reward.is_(None), ~on_episode.exists(), ~on_call.exists())
        .order_by(Episode.created_at, Episode.id)
    )
    if since is not None:
        stmt = stmt.where(Episode.created_at > since)
    rows = await session.execute(stmt)
    return [
        EpisodeRow(
            id=episode.id,
            group_key=episode.group_key,
            meta=dict(episode.meta or {}),
            tags=list(episode.tags or []),
            reward=0.0,
            reward_count=0,
            created_at=episode.created_at,
        )
        for episode in rows.scalars()
    ]


async def episode_calls(session: AsyncSession, episode_ids: Sequence[str]) -> dict[str, list[CallRow]]:
    """The calls of each episode in position order (chunked so huge selections stay under bind limits)."""
    out: dict[str, list[CallRow]] = defaultdict(list)
    ids = list(episode_ids)
    for start in range(0, len(ids), 500):
        rows = await session.execute(
            select(Call)
            .where(Call.episode_id.in_(ids[start : start + 500]))
            .order_by(Call.episode_id, Call.position)
        )
        for call in rows.scalars():
            out[call.episode_id].append(
                CallRow(
                    id=call.id,
                    episode_id=call.episode_id,
                    position=call.position,
                    status=call.status,
                    request=dict(call.request),
                    response=call.response,
                    prompt_token_ids=call.prompt_token_ids,
                    completion_token_ids=call.completion_token_ids,
                    completion_logprobs=call.completion_logprobs,
                    context_hash=call.context_hash,
                    group_key=call.group_key,
                    adapter_version=call.adapter_version,
                )
            )
    return dict(out)


async def last_data_cutoff(session: AsyncSession, policy_id: int) -> datetime | None:
    """Where the previous successful training run's data window ended (its start if it recorded none)."""
    run = (
        await session.execute(
            select(TrainingRun)
            .where(
                TrainingRun.policy_id == policy_id,
                TrainingRun.kind == "train",
                TrainingRun.status == "succeeded",
            )
            .order_by(TrainingRun.started_at.desc())
            .limit(1)
        )
    ).scalar_one_or_none()
    if run is None:
        return None
    until = (run.config or {}).get("data_until")
    return datetime.fromisoformat(until) if isinstance(until, str) else run.started_at


async def start_run(
    session: AsyncSession, policy_id: int, from_version: int | None, config: dict[str, Any]
) -> int:
    """Insert a `running` training run and return its id."""
    row = TrainingRun(
        policy_id=policy_id, kind="train", status="running", from_version=from_version, config=config
    )
    session.add(row)
    await session.flush()
    return row.id


async def finish_run(
    session: AsyncSession,
    run_id: int,
    *,
    status: str,
    metrics: dict[str, Any],
    to_version: int | None = None,
    error: str | None = None,
    config_update: dict[str, Any] | None = None,
) -> None:
    """Record a run's outcome; `config_update` merges into its config (e.g. the data window it used)."""
    values: dict[str, Any] = {
        "status": status,
        "metrics": metrics,
        "to_version": to_version,
        "error": error,
        "finished_at": datetime.now(UTC),
    }
    if config_update:
        config = await session.scalar(select(TrainingRun.config).where(TrainingRun.id == run_id))
        values["config"] = {**(config or {}), **config_update}
    await session.execute(update(TrainingRun).where(TrainingRun.id == run_id).values(**values))
