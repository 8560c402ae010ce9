"""`GET /v1/episodes/{id}` (the trajectory with its rewards and tool calls) and `PUT /v1/episodes/{id}`
(metadata, tags)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec
from litestar import Controller, Request, get, put
from litestar.di import NamedDependency
from litestar.params import FromPath
from msgspec import UNSET, Struct, UnsetType
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.auth import Principal, principal_of, requires
from gateway.body_depth import refuse_too_deep
from gateway.capture.sink import CaptureSink
from gateway.controllers.params import PathName
from gateway.errors import APIError, InvalidRequest, NotFound
from gateway.routing import ModelRouter
from storage.episodes import EpisodeTranscript, episode_policy, get_transcript, update_episode
from storage.rewards import RewardInfo, rewards_for_episodes
from storage.tool_calls import ToolCallInfo, episode_tool_calls


# The API's names differ from storage's in places (`request_id` is a call's id): fields are renamed, and
# `msgspec.convert(..., from_attributes=True)` fills them from the storage dataclasses.
class TurnOut(Struct):
    call_id: str = msgspec.field(name="request_id")
    position: int
    model: str
    status: str
    message: dict[str, Any] | None
    finish_reason: str | None
    usage: dict[str, Any] | None
    created_at: datetime


class RewardOut(Struct):
    id: int
    call_id: str | None = msgspec.field(name="request_id")
    source: str
    name: str
    value: float
    label: str | None
    comment: str | None
    metadata: dict[str, Any]
    created_at: datetime


class ToolCallOut(Struct):
    """A call of one of the policy's tools made through `/mcp/<policy>` for this episode."""

    id: str
    tool: str
    source: str
    arguments: Any
    result: str
    is_error: bool
    latency_ms: float
    created_at: datetime


class EpisodeOut(Struct):
    episode_id: str = msgspec.field(name="id")
    policy: str | None
    group_key: str | None
    source: str
    metadata: dict[str, Any]
    tags: list[Any]
    reward: float | None
    reward_provenance: dict[str, Any] | None
    messages: list[dict[str, Any]]
    turns: list[TurnOut]
    rewards: list[RewardOut] = []
    tool_calls: list[ToolCallOut] = []
    created_at: datetime | None = None
    updated_at: datetime | None = None


class EpisodeUpdate(Struct, forbid_unknown_fields=True):
    metadata: dict[str, Any] | UnsetType = UNSET
    tags: list[str] | UnsetType = UNSET


def _out(trajectory: EpisodeTranscript, rewards: list[RewardInfo], tools: list[ToolCallInfo]) -> EpisodeOut:
    out = msgspec.convert(trajectory, EpisodeOut, from_attributes=True)
    return msgspec.structs.replace(
        out,
        rewards=msgspec.convert(rewards, list[RewardOut], from_attributes=True),
        # Only the calls made with a key of the episode's project: an id another project guessed is not its.
        tool_calls=msgspec.convert(
            [c for c in tools if c.project == trajectory.project], list[ToolCallOut], from_attributes=True
        ),
    )


class EpisodeNotWritten(APIError):
    status_code = 409


async def load_episode(
    session: AsyncSession,
    sink: CaptureSink,
    episode_id: str,
    principal: Principal,
    *,
    whole: bool = True,
) -> EpisodeOut:
    """The episode as stored; `whole`: only once none of its turns waits in a capture queue.

    The queue is asked before the database is read: a turn the writer commits between the two is then either
    still queued (409) or in the read. Read first, such a turn was in neither, and the episode was served cut
    short, or not found at all."""
    queued = await sink.episode_queued(episode_id)
    trajectory = await get_transcript(session, episode_id)
    if trajectory is not None and not principal.sees(trajectory.project):
        raise NotFound(f"no episode {episode_id!r}", code="episode_not_found")  # as if unknown
    # Not written yet, or only some of its turns: a judge or a training run must not read an agent run cut
    # short. Once everything is written, a missing episode was deleted (retention) and is simply not found.
    if (trajectory is None or whole) and queued:
        raise EpisodeNotWritten(
            f"episode {episode_id!r} has turns still in the capture queue; retry shortly",
            code="episode_not_written",
            retry_after=1.0,
        )
    if trajectory is None:
        raise NotFound(f"no episode {episode_id!r}", code="episode_not_found")
    rewards = (await rewards_for_episodes(session, [episode_id]))[episode_id]
    return _out(trajectory, rewards, await episode_tool_calls(session, episode_id))


class EpisodesController(Controller):
    """Episodes of the key's project only; another project's episode is answered 404, as if unknown."""

    path = "/episodes"
    guards = [requires("read")]  # noqa: RUF012

    @get("/{episode_id:str}")
    async def read(
        self,
        request: Request[Any, Any, Any],
        episode_id: FromPath[PathName],
        session: NamedDependency[AsyncSession],
        sink: NamedDependency[CaptureSink],
    ) -> EpisodeOut:
        return await load_episode(session, sink, episode_id, principal_of(request))

    @put("/{episode_id:str}")
    async def edit(
        self,
        episode_id: FromPath[PathName],
        request: Request[Any, Any, Any],
        session: NamedDependency[AsyncSession],
        sink: NamedDependency[CaptureSink],
        router: NamedDependency[ModelRouter],
    ) -> EpisodeOut:
        """Replace the metadata and/or the tags given; fields left out are kept. They are redacted by the
        episode's policy, like everything captured for it."""
        try:
            change = msgspec.json.decode(await request.body(), type=EpisodeUpdate)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise InvalidRequest(str(exc), code="invalid_value") from exc
        principal = principal_of(request)
        metadata = None if isinstance(change.metadata, UnsetType) else change.metadata
        tags = None if isinstance(change.tags, UnsetType) else list(change.tags)
        refuse_too_deep({"metadata": metadata}, param="metadata")  # its depth in the body
        _, policy = await episode_policy(session, episode_id)
        redactor = router.redactor(policy)
        if redactor is not None:
            metadata, tags = redactor.value(metadata), redactor.value(tags)
        found = await update_episode(
            session,
            episode_id,
            metadata=metadata,
            tags=tags,
            project=None if principal.all_projects else principal.project,
        )
        if not found:
            await load_episode(session, sink, episode_id, principal)  # raises the right 404 / 409
        # Edited as stored: an agent may tag its episode while its latest turn is still on its way.
        return await load_episode(session, sink, episode_id, principal, whole=False)
