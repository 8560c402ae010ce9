"""Retention: prune captured calls older than a cut-off and adapter versions nobody can be served any more.

Calls are pruned by age whether or not a policy row owns their model: a policy's calls follow the policy's
`schedule.retention.calls_days`, every other call (traffic in front of an upstream model, or of a policy since
deleted) follows the process-wide `retention_calls_days`. On SQLite the deleted text would stay in the WAL
file until a checkpoint, so `checkpoint_wal` truncates it after the deletes commit.

A version is kept when it is active, pinned, among the newest `keep` versions, or the one a rollback would
re-activate; everything else of the policy is deleted (rows here; the caller removes the directories).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime

from sqlalchemy import ColumnElement, delete, exists, literal, or_, select, text, true
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import InstrumentedAttribute

from storage.calls import CALL_CLOCK_SLACK
from storage.dialect import utc
from storage.models import (
    Adapter,
    Call,
    Episode,
    Policy,
    Reward,
    Rollout,
    StitchKey,
    StoredResponse,
    VersionPin,
)
from storage.policies import AdapterInfo, list_adapters
from storage.rollups import mark_changed, mark_span

_CHUNK = 500


def _chunks(ids: Sequence[str]) -> list[Sequence[str]]:
    return [ids[i : i + _CHUNK] for i in range(0, len(ids), _CHUNK)]


def _owned_by(column: InstrumentedAttribute[str | None], policy: str | None) -> ColumnElement[bool]:
    """The rows of `policy`, or (None) those no policy row owns."""
    if policy is not None:
        return column == policy
    return or_(column.is_(None), ~exists().where(Policy.name == column))


async def prune_calls(session: AsyncSession, policy: str | None, before: datetime) -> tuple[int, int]:
    """Delete the policy's calls created before `before` (None: the calls no policy row owns), then the
    episodes left without calls.

    Rewards and stored responses of what is deleted go with it, and the dashboard's rollup is marked to be
    summed again where they were counted. Returns (calls, episodes) deleted; the caller commits.
    """
    old = Call.created_at < before  # also keeps PostgreSQL's deletes in the day partitions before `before`
    doomed = (
        await session.execute(select(Call.id, Call.created_at).where(_owned_by(Call.policy, policy), old))
    ).all()
    call_ids = [call_id for call_id, _ in doomed]
    started = [created_at for _, created_at in doomed]
    feedback_at: list[datetime] = []
    for chunk in _chunks(call_ids):
        feedback_at += await _delete_rewards(session, Reward.call_id.in_(chunk))
        await session.execute(delete(StoredResponse).where(StoredResponse.call_id.in_(chunk)))
        await session.execute(delete(Call).where(Call.id.in_(chunk), old))
    candidates = select(Episode.id, Episode.created_at).where(
        _owned_by(Episode.policy, policy), Episode.created_at < before
    )
    if session.get_bind().dialect.name == "postgresql":
        # One probe per episode, of the day partitions from its start on: as a NOT EXISTS the planner would hash
        # every call of the table.
        probe = (
            select(literal(1).label("found"))
            .where(
                Call.episode_id == Episode.id,
                Call.created_at >= Episode.created_at - literal(CALL_CLOCK_SLACK),
            )
            .limit(1)
            .lateral()
        )
        candidates = candidates.outerjoin(probe, true()).where(probe.c.found.is_(None))
    else:
        candidates = candidates.where(~exists().where(Call.episode_id == Episode.id))
    orphans = (await session.execute(candidates)).all()
    episode_ids = [episode_id for episode_id, _ in orphans]
    started += [created_at for _, created_at in orphans]
    for chunk in _chunks(episode_ids):
        feedback_at += await _delete_rewards(session, Reward.episode_id.in_(chunk))
        await session.execute(delete(StitchKey).where(StitchKey.episode_id.in_(chunk)))
        await session.execute(delete(Episode).where(Episode.id.in_(chunk)))
    # The dashboard's rollup counted these rows in [oldest, before), and feedback by when it arrived.
    if started:
        await mark_span(session, min(utc(at) for at in started), before)
    await mark_changed(session, feedback_at)
    return len(call_ids), len(episode_ids)


async def _delete_rewards(session: AsyncSession, condition: ColumnElement[bool]) -> list[datetime]:
    """Delete these rewards; returns when the feedback among them arrived (the rollup counts it then)."""
    deleted = await session.execute(
        delete(Reward).where(condition).returning(Reward.source, Reward.created_at)
    )
    return [created_at for source, created_at in deleted if source == "feedback"]


async def checkpoint_wal(session: AsyncSession) -> None:
    """On SQLite, copy the WAL into the database file and truncate it, so deleted text leaves the WAL."""
    if session.get_bind().dialect.name == "sqlite":
        await session.execute(text("PRAGMA wal_checkpoint(TRUNCATE)"))


def versions_to_keep(
    adapters: Sequence[AdapterInfo], active: int | None, keep: int, serving: Iterable[int] = ()
) -> set[int]:
    """Active, pinned, the newest `keep`, the rollback target (newest retired below the active one), and those
    `serving` beside the active one (on trial in a running rollout, or pinned for a project or key)."""
    kept = {a.version for a in adapters if a.pinned or a.status == "active"} | set(serving)
    if active is not None:
        kept.add(active)
        earlier = [a.version for a in adapters if a.status == "retired" and a.version < active]
        if earlier:
            kept.add(max(earlier))
    kept.update(sorted(a.version for a in adapters)[-keep:] if keep > 0 else [])
    return kept


async def prune_adapters(
    session: AsyncSession, policy_id: int, active: int | None, keep: int
) -> list[AdapterInfo]:
    """Delete the rows of versions not worth keeping; returns them so their directories can go too."""
    adapters = await list_adapters(session, policy_id)
    trials = select(Rollout.version).where(Rollout.policy_id == policy_id, Rollout.status == "running")
    pins = select(VersionPin.version).where(VersionPin.policy_id == policy_id)
    serving = set((await session.execute(trials.union(pins))).scalars())
    kept = versions_to_keep(adapters, active, keep, serving)
    doomed = [a for a in adapters if a.version not in kept]
    if doomed:
        await session.execute(
            delete(Adapter).where(
                Adapter.policy_id == policy_id, Adapter.version.in_([a.version for a in doomed])
            )
        )
    return doomed
