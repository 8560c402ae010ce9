"""Repository functions of the scheduler: run rows of every kind, and when a job last ran.

When a job last ran is read back from `training_runs`, so a restarted scheduler knows which runs it missed.
The lock that keeps a policy's jobs apart is in `storage.locks`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from storage.models import Adapter, Episode, Policy, TrainingRun
from storage.policies import episodes_of


@dataclass(frozen=True)
class RunInfo:
    id: int
    policy: str
    kind: str
    status: str
    from_version: int | None
    to_version: int | None
    config: dict[str, Any]
    metrics: dict[str, Any]
    error: str | None
    started_at: datetime
    finished_at: datetime | None


def _run(row: TrainingRun, policy: str) -> RunInfo:
    return RunInfo(
        row.id,
        policy,
        row.kind,
        row.status,
        row.from_version,
        row.to_version,
        dict(row.config or {}),
        dict(row.metrics or {}),
        row.error,
        _utc(row.started_at),
        _utc(row.finished_at) if row.finished_at is not None else None,
    )


def _utc(value: datetime) -> datetime:
    """SQLite hands back naive datetimes; they were written in UTC."""
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


async def start_job_run(
    session: AsyncSession, policy_id: int, kind: str, from_version: int | None, config: dict[str, Any]
) -> int:
    """Insert a `running` row of `kind` (judge, retention, or a train run the trainer never started)."""
    row = TrainingRun(
        policy_id=policy_id, kind=kind, status="running", from_version=from_version, config=config
    )
    session.add(row)
    await session.flush()
    return row.id


async def update_run(session: AsyncSession, run_id: int, **values: Any) -> None:
    """Set columns of a run; `metrics_update` merges into its metrics instead of replacing them."""
    merge = values.pop("metrics_update", None)
    if merge:
        metrics = await session.scalar(select(TrainingRun.metrics).where(TrainingRun.id == run_id))
        values["metrics"] = {**(metrics or {}), **merge}
    await session.execute(update(TrainingRun).where(TrainingRun.id == run_id).values(**values))


async def get_run(session: AsyncSession, run_id: int) -> RunInfo | None:
    row = (
        await session.execute(
            select(TrainingRun, Policy.name)
            .join(Policy, Policy.id == TrainingRun.policy_id)
            .where(TrainingRun.id == run_id)
        )
    ).one_or_none()
    return _run(row[0], row[1]) if row is not None else None


async def list_runs(
    session: AsyncSession,
    policy: str | None = None,
    kind: str | None = None,
    limit: int = 100,
    *,
    status: str | None = None,
    before_id: int | None = None,
) -> list[RunInfo]:
    """Runs, newest first; `before_id` pages on (runs with smaller ids only)."""
    stmt = select(TrainingRun, Policy.name).join(Policy, Policy.id == TrainingRun.policy_id)
    if policy is not None:
        stmt = stmt.where(Policy.name == policy)
    if kind is not None:
        stmt = stmt.where(TrainingRun.kind == kind)
    if status is not None:
        stmt = stmt.where(TrainingRun.status == status)
    if before_id is not None:
        stmt = stmt.where(TrainingRun.id < before_id)
    rows = await session.execute(stmt.order_by(TrainingRun.id.desc()).limit(limit))
    return [_run(run, name) for run, name in rows]


async def latest_run_id(session: AsyncSession, policy_id: int, kind: str) -> int:
    """The id of the newest run of `kind` (0 when there is none): runs started later have larger ids."""
    latest = await session.scalar(
        select(func.max(TrainingRun.id)).where(TrainingRun.policy_id == policy_id, TrainingRun.kind == kind)
    )
    return int(latest or 0)


async def last_run_at(session: AsyncSession, policy_id: int, kind: str) -> datetime | None:
    """When a job of `kind` last started for the policy, whatever its outcome."""
    started = await session.scalar(
        select(func.max(TrainingRun.started_at)).where(
            TrainingRun.policy_id == policy_id, TrainingRun.kind == kind
        )
    )
    return _utc(started) if started is not None else None


async def count_rewarded_episodes(session: AsyncSession, policy: str, since: datetime | None) -> int:
    """Episodes of `policy` (`episodes_of`) with a derived reward created after `since` (the threshold trigger)."""
    stmt = select(func.count()).select_from(Episode).where(episodes_of(policy), Episode.reward.is_not(None))
    if since is not None:
        stmt = stmt.where(Episode.created_at > since)
    return int(await session.scalar(stmt) or 0)


async def set_adapter_status(session: AsyncSession, policy_id: int, version: int, status: str) -> None:
    """E.g. `rejected` for a candidate the evaluation gate turned down (it stays on disk for inspection)."""
    await session.execute(
        update(Adapter)
        .where(Adapter.policy_id == policy_id, Adapter.version == version)
        .values(status=status)
    )
