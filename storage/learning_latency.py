"""How long a policy takes to learn: from a reward arriving to the version trained on it serving traffic.

For the version a policy serves now (its active one), the training run that produced it (`to_version`) read the
rewarded episodes of its data window, (`data_since`, `data_until`] by episode start, as `storage.training.
rewarded_episodes` selects them. The rewards it learned from are the reward rows of those episodes (named
directly or through one of their calls) that had arrived (`rewards.created_at`) when it read them: by
`data_until`, or by the run's start when the window was set to end earlier. The latency of each is the time
from its arrival to the version's `serving_since`.

Three figures sum it up: the newest reward's latency (the freshest signal the serving version has learned
from), the median and the oldest. The learner's own filters (tags, metadata, fewest rewards, the newest
`max_episodes`, the gate's held-out groups) are not applied: they narrow which of the window's episodes it
kept, not when their rewards arrived. A derived episode reward with no reward row behind it (an import) has
no arrival time and is not counted. A version promoted before `serving_since` was recorded, or made by no
training run (the initial adapter), has no latency.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Select, func, or_, select, union_all
from sqlalchemy.ext.asyncio import AsyncSession

from storage.calls import CALL_CLOCK_SLACK
from storage.dialect import utc
from storage.models import Adapter, Call, Episode, Policy, Reward, TrainingRun
from storage.policies import episodes_of


@dataclass(frozen=True)
class LearningLatency:
    """From the rewards a policy's serving version was trained on to that version serving, in seconds."""

    policy: str
    version: int
    run_id: int  # the training run that produced the version
    serving_since: datetime
    rewards: int  # reward rows the run learned from
    newest_s: float  # the newest reward's arrival to serving: the freshest learning signal
    median_s: float
    oldest_s: float


def _parse(value: Any) -> datetime | None:
    return utc(datetime.fromisoformat(value)) if isinstance(value, str) else None


def _arrivals(policy: str, since: datetime | None, until: datetime, read_at: datetime) -> Select[Any]:
    """When each reward row of the policy's rewarded episodes started in (since, until] arrived, up to `read_at`:
    the rows `rewarded_episodes` averaged for that window, read at that time."""
    in_window = [episodes_of(policy), Episode.created_at <= until]
    if since is not None:
        in_window.append(Episode.created_at > since)
    window = select(Episode.id, Episode.project).where(*in_window).cte("window")
    named = select(
        Reward.episode_id.label("owner"), Reward.created_at.label("arrived"), Reward.project
    ).where(Reward.episode_id.in_(select(window.c.id)), Reward.created_at <= read_at)
    via_call = (
        select(Call.episode_id.label("owner"), Reward.created_at.label("arrived"), Reward.project)
        .join(Call, Reward.call_id == Call.id)
        .where(
            Reward.episode_id.is_(None),
            Call.episode_id.in_(select(window.c.id)),
            Reward.created_at <= read_at,
        )
    )
    if since is not None:
        via_call = via_call.where(Call.created_at > since - CALL_CLOCK_SLACK)
    signals = union_all(named, via_call).subquery()
    return (
        select(signals.c.arrived)
        .join(window, window.c.id == signals.c.owner)
        # Early feedback from a key of another project never counted for an episode.
        .where(or_(signals.c.project.is_(None), signals.c.project == window.c.project))
    )


async def _latency(
    session: AsyncSession, policy: str, version: int, serving_since: datetime, run: TrainingRun
) -> LearningLatency | None:
    started = utc(run.started_at)
    config = run.config or {}
    until = _parse(config.get("data_until")) or started
    arrivals = _arrivals(policy, _parse(config.get("data_since")), until, max(until, started)).subquery()
    n, first, last = (
        await session.execute(
            select(func.count(), func.min(arrivals.c.arrived), func.max(arrivals.c.arrived))
        )
    ).one()
    if not n:
        return None
    # The middle one or two arrivals: a sort of the run's rewards, with no percentile function SQLite lacks.
    middle = [
        utc(at)
        for at in await session.scalars(
            select(arrivals.c.arrived)
            .order_by(arrivals.c.arrived)
            .offset((n - 1) // 2)
            .limit(2 if n % 2 == 0 else 1)
        )
    ]
    median = sum((serving_since - at).total_seconds() for at in middle) / len(middle)
    return LearningLatency(
        policy,
        version,
        run.id,
        serving_since,
        int(n),
        (serving_since - utc(last)).total_seconds(),
        median,
        (serving_since - utc(first)).total_seconds(),
    )


LatencyKey = tuple[int, int, int, datetime]
"""What a latency depends on: the policy's id, the serving version, the run that made it and `serving_since`."""


async def learning_latency(
    session: AsyncSession,
    policy: str | None = None,
    *,
    memo: dict[LatencyKey, LearningLatency | None] | None = None,
) -> list[LearningLatency]:
    """The latency of every policy's serving version (only `policy`'s when given), by policy name; a policy
    whose serving version has none (see the module's docstring) is left out.

    `memo`: the figures of earlier calls. They are settled once a version serves (a reward arriving later was
    not read by its run), so a caller that reads them again and again (/metrics, each interval) computes each
    once, a sort of a run's rewards, rather than every time; entries of versions no longer serving are dropped."""
    query = (
        select(Policy.id, Policy.name, Adapter.version, Adapter.serving_since)
        .join(Adapter, (Adapter.policy_id == Policy.id) & (Adapter.version == Policy.active_version))
        .order_by(Policy.name)
    )
    if policy is not None:
        query = query.where(Policy.name == policy)
    out = []
    serving: set[LatencyKey] = set()
    for policy_id, name, version, serving_since in (await session.execute(query)).all():
        if serving_since is None:  # promoted before it was recorded
            continue
        run = await session.scalar(
            select(TrainingRun)
            .where(
                TrainingRun.policy_id == policy_id,
                TrainingRun.kind == "train",
                TrainingRun.to_version == version,
            )
            .order_by(TrainingRun.id.desc())
            .limit(1)
        )
        if run is None:
            continue
        key = (policy_id, version, run.id, utc(serving_since))
        serving.add(key)
        if memo is not None and key in memo:
            latency = memo[key]
        else:
            latency = await _latency(session, name, version, utc(serving_since), run)
            if memo is not None:
                memo[key] = latency
        if latency is not None:
            out.append(latency)
    if memo is not None and policy is None:
        for gone in memo.keys() - serving:
            del memo[gone]
    return out
