"""`GET /v1/episodes/{id}` (the trajectory with its rewards) and `PUT /v1/episodes/{id}` (metadata, tags)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec
from litestar import Controller, Request, get, put
from litestar.di import NamedDependency
from litestar.params import FromPath
from msgspec import UNSET, Struct, UnsetType

from gateway.capture import CaptureSink
from gateway.errors import APIError, InvalidRequest, NotFound
from storage.database import Database
from storage.episodes import Trajectory, get_trajectory, update_episode
from storage.rewards import RewardInfo, rewards_for_episodes


class TurnOut(Struct):
    request_id: str
    position: int
    model: str
    status: str
    message: dict[str, Any] | None
    finish_reason: str | None
    usage: dict[str, Any] | None
    created_at: datetime


class RewardOut(Struct):
    id: int
    request_id: str | None
    source: str
    name: str
    value: float
    label: str | None
    comment: str | None
    metadata: dict[str, Any]
    created_at: datetime


class EpisodeOut(Struct):
    id: str
    policy: str | None
    group_key: str | None
    metadata: dict[str, Any]
    tags: list[Any]
    reward: float | None
    reward_provenance: dict[str, Any] | None
    messages: list[dict[str, Any]]
    turns: list[TurnOut]
    rewards: list[RewardOut]
    created_at: datetime | None
    updated_at: datetime | None


class EpisodeUpdate(Struct, forbid_unknown_fields=True):
    metadata: dict[str, Any] | UnsetType = UNSET
    tags: list[str] | UnsetType = UNSET


def _out(trajectory: Trajectory, rewards: list[RewardInfo]) -> EpisodeOut:
    return EpisodeOut(
        id=trajectory.episode_id,
        policy=trajectory.policy,
        group_key=trajectory.group_key,
        metadata=trajectory.metadata,
        tags=trajectory.tags,
        reward=trajectory.reward,
        reward_provenance=trajectory.reward_provenance,
        messages=trajectory.messages,
        turns=[
            TurnOut(
                t.call_id, t.position, t.model, t.status, t.message, t.finish_reason, t.usage, t.created_at
            )
            for t in trajectory.turns
        ],
        rewards=[
            RewardOut(
                r.id, r.call_id, r.source, r.name, r.value, r.label, r.comment, r.metadata, r.created_at
            )
            for r in rewards
        ],
        created_at=trajectory.created_at,
        updated_at=trajectory.updated_at,
    )


class EpisodeNotWritten(APIError):
    status_code = 409


class EpisodesController(Controller):
    path = "/episodes"

    async def _load(self, database: Database, sink: CaptureSink, episode_id: str) -> EpisodeOut:
        async with database.session() as session:
            trajectory = await get_trajectory(session, episode_id)
            if trajectory is not None:
                rewards = (await rewards_for_episodes(session, [episode_id]))[episode_id]
                return _out(trajectory, rewards)
        # Known to this process and not yet written; once everything is written, a missing episode was
        # deleted (retention) and is simply not found.
        if sink.recent.episode(episode_id)[0] and sink.settling:
            raise EpisodeNotWritten(
                f"episode {episode_id!r} is still in the capture queue; retry shortly",
                code="episode_not_written",
                retry_after=1.0,
            )
        raise NotFound(f"no episode {episode_id!r}", code="episode_not_found")

    @get("/{episode_id:str}")
    async def read(
        self,
        episode_id: FromPath[str],
        database: NamedDependency[Database],
        sink: NamedDependency[CaptureSink],
    ) -> EpisodeOut:
        return await self._load(database, sink, episode_id)

    @put("/{episode_id:str}")
    async def edit(
        self,
        episode_id: FromPath[str],
        request: Request[Any, Any, Any],
        database: NamedDependency[Database],
        sink: NamedDependency[CaptureSink],
    ) -> EpisodeOut:
        """Replace the metadata and/or the tags given; fields left out are kept."""
        try:
            change = msgspec.json.decode(await request.body(), type=EpisodeUpdate)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise InvalidRequest(str(exc), code="invalid_value") from exc
        async with database.session() as session:
            found = await update_episode(
                session,
                episode_id,
                metadata=None if isinstance(change.metadata, UnsetType) else change.metadata,
                tags=None if isinstance(change.tags, UnsetType) else list(change.tags),
            )
            await session.commit()
        if not found:
            await self._load(database, sink, episode_id)  # raises the right 404 / 409
        return await self._load(database, sink, episode_id)
