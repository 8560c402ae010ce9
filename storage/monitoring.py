"""Aggregates that monitoring reads: active versions, stored rewards, judge groups and their cost, job runs, the
last day's live reward per policy and serving version, the time from reward to serving, and rollouts.

These numbers live in the database because other processes write them (a training child, a worker, another
replica's scheduler), so a gateway's `/metrics` reads them here instead of counting them itself. Each is one
grouped query over indexed or small tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, Float, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from storage.learning_latency import LatencyKey, LearningLatency, learning_latency
from storage.models import JudgeGroup, Policy, Reward, Rollout, TrainingRun
from storage.version_rewards import RewardStats, live_rewards

LIVE_REWARD_WINDOW = timedelta(hours=24)
"""/metrics reports the live reward of the episodes started this long ago at most: recent enough to follow a
promotion, and a read bounded by a day's traffic rather than everything ever captured."""


@dataclass(frozen=True)
class JudgeTotals:
    policy: str
    status: str  # judged | failed
    groups: int
    calls: int  # judge requests, retries included
    cost_usd: float


@dataclass(frozen=True)
class RunTotals:
    policy: str
    kind: str  # train | judge | retention
    status: str  # running | succeeded | skipped | failed | rejected
    runs: int
    finished: int
    duration_s: float  # summed over the finished runs
    last_finished_at: datetime | None


@dataclass(frozen=True)
class RunningRollout:
    """A rollout in progress and its last evaluation's difference (candidate - baseline), when it has one."""

    policy: str
    mode: str  # canary | split | shadow
    version: int
    share: float
    estimate: float | None
    low: float | None
    high: float | None


@dataclass(frozen=True)
class StoreCounts:
    active_versions: dict[str, int | None] = field(default_factory=dict)
    rewards: dict[tuple[str, str], int] = field(default_factory=dict)  # (source, status) -> rows
    judge: list[JudgeTotals] = field(default_factory=list)
    runs: list[RunTotals] = field(default_factory=list)
    # (policy, serving version of the first call) -> rewarded episodes of the last LIVE_REWARD_WINDOW
    live_rewards: dict[tuple[str, int | None], RewardStats] = field(default_factory=dict)
    learning_latency: list[LearningLatency] = field(default_factory=list)
    rollouts: dict[tuple[str, str], int] = field(default_factory=dict)  # (policy, status) -> rollouts
    running_rollouts: list[RunningRollout] = field(default_factory=list)  # oldest first


def _duration_s(session: AsyncSession) -> ColumnElement[Any]:
    """finished_at - started_at in seconds, in the session's SQL dialect."""
    if session.get_bind().dialect.name == "postgresql":
        return func.extract("epoch", TrainingRun.finished_at - TrainingRun.started_at)
    seconds = (func.julianday(TrainingRun.finished_at) - func.julianday(TrainingRun.started_at)) * 86400.0
    return func.cast(seconds, Float)


def _utc(value: datetime | None) -> datetime | None:
    """SQLite hands timestamps back without their zone; Kaizen writes them in UTC."""
    return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value


async def store_counts(
    session: AsyncSession, *, latency_memo: dict[LatencyKey, LearningLatency | None] | None = None
) -> StoreCounts:
    """`latency_memo`: the reader's memo of reward-to-serving figures, computed once per serving version
    (`learning_latency`)."""
    policies = await session.execute(select(Policy.name, Policy.active_version))
    rewards = await session.execute(
        select(Reward.source, Reward.status, func.count()).group_by(Reward.source, Reward.status)
    )
    judge = await session.execute(
        select(
            JudgeGroup.policy,
            JudgeGroup.status,
            func.count(),
            func.coalesce(func.sum(JudgeGroup.attempts), 0),
            func.coalesce(func.sum(JudgeGroup.cost_usd), 0.0),
        ).group_by(JudgeGroup.policy, JudgeGroup.status)
    )
    duration = _duration_s(session)
    runs = await session.execute(
        select(
            Policy.name,
            TrainingRun.kind,
            TrainingRun.status,
            func.count(),
            func.count(TrainingRun.finished_at),
            func.coalesce(func.sum(duration), 0.0),
            func.max(TrainingRun.finished_at),
        )
        .join(Policy, Policy.id == TrainingRun.policy_id)
        .group_by(Policy.name, TrainingRun.kind, TrainingRun.status)
    )
    live = await live_rewards(session, datetime.now(UTC) - LIVE_REWARD_WINDOW)
    rollouts = await session.execute(
        select(Policy.name, Rollout.status, func.count())
        .join(Policy, Policy.id == Rollout.policy_id)
        .group_by(Policy.name, Rollout.status)
    )
    running = await session.execute(
        select(Policy.name, Rollout.mode, Rollout.version, Rollout.share, Rollout.stats)
        .join(Policy, Policy.id == Rollout.policy_id)
        .where(Rollout.status == "running")
        .order_by(Rollout.started_at, Rollout.id)
    )
    return StoreCounts(
        active_versions={name: version for name, version in policies},
        rewards={(source, status): int(n) for source, status, n in rewards},
        judge=[
            JudgeTotals(policy or "", status, int(n), int(calls or 0), float(cost or 0.0))
            for policy, status, n, calls, cost in judge
        ],
        runs=[
            RunTotals(name, kind, status, int(n), int(done), float(seconds or 0.0), _utc(last))
            for name, kind, status, n, done, seconds, last in runs
        ],
        live_rewards=live,
        learning_latency=await learning_latency(session, memo=latency_memo),
        rollouts={(name, status): int(n) for name, status, n in rollouts},
        running_rollouts=[
            RunningRollout(name, mode, version, float(share), *_difference(stats))
            for name, mode, version, share, stats in running
        ],
    )


def _difference(stats: Any) -> tuple[float | None, float | None, float | None]:
    """`stats["difference"]`'s estimate and interval as the canary last wrote them; None for each one missing
    (no evaluation yet, too few episodes, a mode that does not compare)."""
    difference = stats.get("difference") if isinstance(stats, dict) else None
    if not isinstance(difference, dict):
        return None, None, None

    def number(key: str) -> float | None:
        value = difference.get(key)
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None

    return number("estimate"), number("low"), number("high")
