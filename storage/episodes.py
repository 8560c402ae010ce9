"""Repository functions for episodes: read them whole as transcripts, edit their metadata, find groups.

Everything returned is a plain dataclass; ORM rows never leave this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, literal, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from storage.calls import CALL_CLOCK_SLACK
from storage.dialect import utc
from storage.models import DEFAULT_PROJECT, EPISODE_SOURCE_TRAFFIC, Call, Episode, Reward
from storage.policies import episodes_of


@dataclass(frozen=True)
class Turn:
    """One call of an episode: the assistant's reply (first choice) and what it cost."""

    call_id: str
    position: int
    model: str
    status: str
    message: dict[str, Any] | None
    finish_reason: str | None
    usage: dict[str, Any] | None
    created_at: datetime
    adapter_version: int | None = None  # the policy version that served it


@dataclass(frozen=True)
class EpisodeTranscript:
    """An episode as a judge or a reward function sees it: the whole conversation, in order.

    `messages` is the last call's request messages plus its reply, so it holds every assistant turn of a
    chat loop. Transcripts of episodes Kaizen generates itself (training, evaluation) are built directly.
    (Not the client SDK's `gateway.client.Trajectory`, a handle a rollout writes an episode through.)
    """

    episode_id: str
    messages: list[dict[str, Any]]
    policy: str | None = None
    group_key: str | None = None
    project: str = DEFAULT_PROJECT
    #: `traffic`, or the tool that sent or wrote the episode (`bootstrap`, `import`).
    source: str = EPISODE_SOURCE_TRAFFIC
    context_hash: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    tags: list[Any] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    reward: float | None = None
    reward_provenance: dict[str, Any] | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None
    tools: list[dict[str, Any]] | None = None  # the tools offered with `messages`' last request

    def as_dict(self) -> dict[str, Any]:
        """The JSON form handed to reward functions and scoring webhooks."""
        return {
            "episode_id": self.episode_id,
            "policy": self.policy,
            "group_key": self.group_key,
            "metadata": self.metadata,
            "tags": self.tags,
            "messages": self.messages,
        }


def _reply(response: dict[str, Any] | None) -> tuple[dict[str, Any] | None, str | None]:
    choices = (response or {}).get("choices") or []
    if not choices:
        return None, None
    first = choices[0]
    if "message" not in first and isinstance(first.get("text"), str):  # a text completion's reply
        return {"role": "assistant", "content": first["text"]}, first.get("finish_reason")
    message = {k: v for k, v in (first.get("message") or {}).items() if v is not None}
    return message, first.get("finish_reason")


def _context(request: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages a call answered; a text completion's prompt (a text) is shown as one user turn."""
    if "messages" not in request and isinstance(request.get("prompt"), str):
        return [{"role": "user", "content": request["prompt"]}]
    return list(request.get("messages", []))


async def get_transcripts(session: AsyncSession, episode_ids: list[str]) -> dict[str, EpisodeTranscript]:
    """The stored transcripts of these episodes (missing ids are absent from the result)."""
    if not episode_ids:
        return {}
    episodes = (await session.execute(select(Episode).where(Episode.id.in_(episode_ids)))).scalars().all()
    calls = (
        await session.execute(
            select(
                Call.id,
                Call.episode_id,
                Call.position,
                Call.model,
                Call.status,
                Call.request,
                Call.response,
                Call.usage,
                Call.context_hash,
                Call.created_at,
                Call.adapter_version,
            )
            .where(Call.episode_id.in_(episode_ids))
            .order_by(Call.episode_id, Call.position)
        )
    ).all()
    by_episode: dict[str, list[Any]] = {}
    for row in calls:
        by_episode.setdefault(row.episode_id, []).append(row)
    result: dict[str, EpisodeTranscript] = {}
    for episode in episodes:
        rows = by_episode.get(episode.id, [])
        turns = []
        for row in rows:
            message, finish = _reply(row.response)
            turns.append(
                Turn(
                    row.id,
                    row.position,
                    row.model,
                    row.status,
                    message,
                    finish,
                    row.usage,
                    row.created_at,
                    row.adapter_version,
                )
            )
        messages: list[dict[str, Any]] = []
        tools: list[dict[str, Any]] | None = None
        answered = [
            (row, turn.message) for row, turn in zip(rows, turns, strict=True) if turn.message is not None
        ]
        if answered:
            last_row, last_reply = answered[-1]
            messages = [*_context(last_row.request), last_reply]
            tools = last_row.request.get("tools")
        elif rows:
            messages = _context(rows[-1].request)
            tools = rows[-1].request.get("tools")
        result[episode.id] = EpisodeTranscript(
            episode_id=episode.id,
            messages=messages,
            policy=episode.policy,
            group_key=episode.group_key,
            project=episode.project,
            source=episode.source,
            context_hash=rows[0].context_hash if rows else None,
            metadata=dict(episode.meta or {}),
            tags=list(episode.tags or []),
            turns=turns,
            reward=episode.reward,
            reward_provenance=episode.reward_provenance,
            created_at=episode.created_at,
            updated_at=episode.updated_at,
            tools=tools or None,
        )
    return result


async def get_transcript(session: AsyncSession, episode_id: str) -> EpisodeTranscript | None:
    return (await get_transcripts(session, [episode_id])).get(episode_id)


async def episode_policy(session: AsyncSession, episode_id: str) -> tuple[str | None, str | None]:
    """(project, policy) of an episode; the project is None when the episode is not stored."""
    row = (
        await session.execute(select(Episode.project, Episode.policy).where(Episode.id == episode_id))
    ).first()
    return (None, None) if row is None else (row.project, row.policy)


async def episode_policies(session: AsyncSession, episode_ids: list[str]) -> dict[str, str | None]:
    rows = await session.execute(select(Episode.id, Episode.policy).where(Episode.id.in_(episode_ids)))
    return {episode_id: policy for episode_id, policy in rows}


async def update_episode(
    session: AsyncSession,
    episode_id: str,
    *,
    metadata: dict[str, Any] | None = None,
    tags: list[Any] | None = None,
    project: str | None = None,
) -> bool:
    """Replace an episode's metadata and/or tags (fields left None are kept); False when it does not exist
    (or, given a `project`, belongs to another one)."""
    values: dict[str, Any] = {"updated_at": datetime.now(UTC)}
    if metadata is not None:
        values["meta"] = metadata
    if tags is not None:
        values["tags"] = tags
    query = update(Episode).where(Episode.id == episode_id)
    if project is not None:
        query = query.where(Episode.project == project)
    result = await session.execute(query.values(**values))
    return bool(result.rowcount)  # type: ignore[attr-defined]


async def set_episode_reward(
    session: AsyncSession, episode_id: str, reward: float | None, provenance: dict[str, Any] | None
) -> datetime | None:
    """Store an episode's derived reward; returns when the episode started (None: no such episode)."""
    started: datetime | None = await session.scalar(
        update(Episode)
        .where(Episode.id == episode_id)
        .values(reward=reward, reward_provenance=provenance, updated_at=datetime.now(UTC))
        .returning(Episode.created_at)
    )
    return started


@dataclass(frozen=True)
class GroupCandidate:
    """An episode that could be scored, with what groups it: its `group_key`, else its first context hash."""

    episode_id: str
    group: str
    scored: bool
    created_at: datetime
    last_call_at: datetime  # its newest call: an agent may still be adding turns to a recent one


async def scoring_candidates(
    session: AsyncSession, policy: str, *, source: str, since: datetime | None = None
) -> list[GroupCandidate]:
    """Episodes of a policy (`episodes_of`: its owner's only, when it has one), oldest first, with their grouping
    key and whether `source` scored them already."""
    first_call = (
        select(Call.episode_id, Call.context_hash).where(Call.position == 0, Call.status == "ok").subquery()
    )
    scored = select(Reward.episode_id).where(Reward.source == source, Reward.episode_id.is_not(None))
    # Read from the episode's start on: on PostgreSQL, only the day partitions since then.
    last_call = (
        select(func.max(Call.created_at))
        .where(
            Call.episode_id == Episode.id, Call.created_at >= Episode.created_at - literal(CALL_CLOCK_SLACK)
        )
        .scalar_subquery()
    )
    query = (
        select(
            Episode.id,
            Episode.group_key,
            first_call.c.context_hash,
            Episode.created_at,
            Episode.id.in_(scored).label("scored"),
            last_call.label("last_call_at"),
        )
        .join(first_call, first_call.c.episode_id == Episode.id)
        .where(episodes_of(policy))
        .order_by(Episode.created_at, Episode.id)
    )
    if since is not None:
        query = query.where(Episode.created_at >= since)
    rows = await session.execute(query)
    return [
        GroupCandidate(
            row.id,
            f"key:{row.group_key}" if row.group_key else f"prompt:{row.context_hash}",
            bool(row.scored),
            row.created_at,
            utc(row.last_call_at or row.created_at),
        )
        for row in rows
    ]
