"""Repository functions the trainer needs: rewarded episodes with their calls, and training runs.

Returns plain dataclasses so the trainer never holds ORM objects across its long, database-free training phase.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, or_, select, union_all, update
from sqlalchemy.ext.asyncio import AsyncSession

from storage.calls import CALL_CLOCK_SLACK
from storage.locks import acquire_lock
from storage.models import Call, Episode, Reward, TrainingRun
from storage.policies import PolicyInfo, episodes_of

logger = logging.getLogger(__name__)


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
    """Episodes of `policy` (`episodes_of`: its owner's only, when it has one) created in (since, until] that
    carry a reward, oldest first.

    A reward row counts for an episode when it names the episode or one of its calls. The episode's own
    `reward` column (derived by the policy's rule) wins over the plain mean of its reward rows. Only the window's
    episodes and their rewards are read, whatever the size of the tables.
    """
    in_window = [episodes_of(policy), Episode.created_at <= until]
    if since is not None:
        in_window.append(Episode.created_at > since)
    window = select(Episode.id, Episode.project).where(*in_window).cte("window")
    named = select(Reward.episode_id.label("owner"), Reward.value, Reward.project).where(
        Reward.episode_id.in_(select(window.c.id))
    )
    # A reward that names only a call (not linked yet) counts for the call's episode.
    via_call = (
        select(Call.episode_id.label("owner"), Reward.value, Reward.project)
        .join(Call, Reward.call_id == Call.id)
        .where(Reward.episode_id.is_(None), Call.episode_id.in_(select(window.c.id)))
    )
    if since is not None:
        via_call = via_call.where(Call.created_at > since - CALL_CLOCK_SLACK)
    signals = union_all(named, via_call).subquery()
    counts = (
        select(signals.c.owner, func.avg(signals.c.value).label("mean"), func.count().label("n"))
        .join(window, window.c.id == signals.c.owner)
        # Early feedback from a key of another project never counts for an episode.
        .where(or_(signals.c.project.is_(None), signals.c.project == window.c.project))
        .group_by(signals.c.owner)
        .subquery()
    )
    stmt = (
        select(Episode, counts.c.mean, counts.c.n)
        .outerjoin(counts, counts.c.owner == Episode.id)
        .where(*in_window)
        .where((Episode.reward.is_not(None)) | (counts.c.n > 0))
        .order_by(Episode.created_at, Episode.id)
    )
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
    """Episodes of `policy` (`episodes_of`) from `sources` (`episodes.source`) created in (since, until] that
    carry no reward at all (no derived reward, no reward row for them or their calls), oldest first; their
    `reward` is 0."""
    on_episode = select(Reward.id).where(Reward.episode_id == Episode.id)
    on_call = select(Reward.id).join(Call, Reward.call_id == Call.id).where(Call.episode_id == Episode.id)
    stmt = (
        select(Episode)
        .where(episodes_of(policy), Episode.source.in_(list(sources)), Episode.created_at <= until)
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


async def episode_calls(
    session: AsyncSession, episode_ids: Sequence[str], *, since: datetime | None = None
) -> dict[str, list[CallRow]]:
    """The calls of each episode in position order (chunked so huge selections stay under bind limits).

    `since`: when the earliest of the episodes started; their calls are looked for from then on only."""
    out: dict[str, list[CallRow]] = defaultdict(list)
    ids = list(episode_ids)
    for start in range(0, len(ids), 500):
        query = select(*_CALL_ROW_COLUMNS).where(Call.episode_id.in_(ids[start : start + 500]))
        if since is not None:
            query = query.where(Call.created_at >= since - CALL_CLOCK_SLACK)
        # Plain rows, not ORM objects: a training run reads tens of thousands of calls, and the ORM's
        # bookkeeping per object cost more than the query (measured on 10 million calls).
        for row in await session.execute(query.order_by(Call.episode_id, Call.position)):
            out[row.episode_id].append(CallRow(**row._asdict()))
    return dict(out)


_CALL_ROW_COLUMNS = [getattr(Call, name) for name in CallRow.__dataclass_fields__]


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


#: The error of a run whose process died before it could record an outcome (`fail_abandoned_runs`).
ABANDONED_RUN_ERROR = (
    "abandoned: the process running it stopped before recording an outcome (killed, or its host went away); "
    "marked failed by the next job of the policy"
)


async def fail_abandoned_runs(
    session: AsyncSession, policy_id: int, error: str = ABANDONED_RUN_ERROR
) -> list[int]:
    """Mark failed, with `error`, the policy's runs still `running`: called by a job that holds the policy's lock,
    so no live job can own them; a SIGKILLed gateway or training child leaves its run `running` for ever otherwise
    (and the dashboard shows it training). Returns their ids; the caller commits."""
    ids = list(
        (
            await session.scalars(
                select(TrainingRun.id).where(
                    TrainingRun.policy_id == policy_id, TrainingRun.status == "running"
                )
            )
        ).all()
    )
    if ids:
        await session.execute(
            update(TrainingRun)
            .where(TrainingRun.id.in_(ids))
            .values(status="failed", error=error, finished_at=datetime.now(UTC))
        )
    return ids


async def take_policy_lock(
    session: AsyncSession, policy: PolicyInfo, owner: str, job: str, ttl_s: float
) -> bool:
    """Take the policy's job lock for `owner`, then mark failed the runs a dead job left `running` (no live job can
    own them now); False, with nothing changed, when another job holds the lock. Commits."""
    if not await acquire_lock(session, policy.name, owner, job, ttl_s):
        return False
    if abandoned := await fail_abandoned_runs(session, policy.id):
        logger.warning(
            "run(s) %s of %s were left running by a process that died; marked failed",
            ", ".join(map(str, abandoned)),
            policy.name,
        )
    await session.commit()
    return True


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
