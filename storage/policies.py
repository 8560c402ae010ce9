"""Repository functions for policies and their adapter versions. Returns plain dataclasses, never ORM objects."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import ColumnElement, and_, func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from storage.models import Adapter, Episode, Policy


@dataclass(frozen=True)
class PolicyInfo:
    id: int
    name: str
    base_model: str
    active_version: int | None
    config: dict[str, Any]
    created_at: datetime
    #: The project that owns it (only its keys call it, only its episodes train it); None: shared.
    project: str | None = None

    @property
    def shared(self) -> bool:
        return self.project is None


@dataclass(frozen=True)
class AdapterInfo:
    policy_id: int
    version: int
    status: str
    path: str
    parent_version: int | None
    pinned: bool
    metrics: dict[str, Any]
    created_at: datetime
    #: When it first served traffic (`mark_serving`); None: never yet, or before that was recorded.
    serving_since: datetime | None = None


def _policy(row: Policy) -> PolicyInfo:
    return PolicyInfo(
        row.id, row.name, row.base_model, row.active_version, dict(row.config), row.created_at, row.project
    )


def episodes_of(policy: str) -> ColumnElement[bool]:
    """The condition an episode meets to be `policy`'s for training, judging and export: stored under its name
    and, when the policy is owned by a project, created by a key of that project. Every query that selects a
    policy's episodes to learn from uses it, so another project's episode can never reach an owned policy (the
    owner is read in the same statement: a policy made owned later stops seeing the others' episodes at once)."""
    owner = select(Policy.project).where(Policy.name == policy).scalar_subquery()
    return and_(Episode.policy == policy, or_(owner.is_(None), Episode.project == owner))


def _adapter(row: Adapter) -> AdapterInfo:
    return AdapterInfo(
        row.policy_id,
        row.version,
        row.status,
        row.path,
        row.parent_version,
        row.pinned,
        dict(row.metrics),
        row.created_at,
        row.serving_since,
    )


def adapter_dir(data_dir: Path, policy: str, version: int) -> Path:
    """Where version `version` of `policy` lives in the adapter store (the data directory, shared by replicas)."""
    return data_dir / "adapters" / policy / str(version)


async def relocate_adapters(session: AsyncSession, data_dir: Path) -> int:
    """Point every version at its directory in the adapter store under `data_dir`, where a restore put its files
    (the paths stored are those of the store the backup was taken from); returns how many versions."""
    rows = (
        await session.execute(select(Adapter, Policy.name).join(Policy, Policy.id == Adapter.policy_id))
    ).all()
    for adapter, name in rows:
        adapter.path = str(adapter_dir(data_dir, name, adapter.version).resolve())
    await session.flush()
    return len(rows)


class PolicyExists(ValueError):
    pass


async def create_policy(
    session: AsyncSession,
    name: str,
    base_model: str,
    config: dict[str, Any] | None = None,
    *,
    project: str | None = None,
) -> PolicyInfo:
    """Insert a policy (without versions yet), owned by `project` (None: shared); raises `PolicyExists` if the
    name is taken."""
    if await get_policy(session, name) is not None:
        raise PolicyExists(f"policy {name!r} already exists")
    row = Policy(name=name, base_model=base_model, config=config or {}, project=project)
    session.add(row)
    await session.flush()
    return _policy(row)


async def get_policy(session: AsyncSession, name: str) -> PolicyInfo | None:
    row = (await session.execute(select(Policy).where(Policy.name == name))).scalar_one_or_none()
    return _policy(row) if row is not None else None


async def list_policies(session: AsyncSession) -> list[PolicyInfo]:
    rows = (await session.execute(select(Policy).order_by(Policy.name))).scalars().all()
    return [_policy(r) for r in rows]


async def update_policy_config(session: AsyncSession, policy_id: int, config: dict[str, Any]) -> None:
    await session.execute(update(Policy).where(Policy.id == policy_id).values(config=config))


async def set_policy_owner(session: AsyncSession, policy_id: int, project: str | None) -> None:
    """Give the policy to `project`, or share it (None). Its training data follows at once (`episodes_of`);
    gateways refuse other projects' calls from their next policy refresh."""
    await session.execute(update(Policy).where(Policy.id == policy_id).values(project=project))


async def add_adapter(
    session: AsyncSession,
    policy_id: int,
    version: int,
    path: str,
    *,
    status: str = "candidate",
    parent_version: int | None = None,
    metrics: dict[str, Any] | None = None,
) -> AdapterInfo:
    row = Adapter(
        policy_id=policy_id,
        version=version,
        path=path,
        status=status,
        parent_version=parent_version,
        metrics=metrics or {},
    )
    session.add(row)
    await session.flush()
    return _adapter(row)


async def next_version(session: AsyncSession, policy_id: int) -> int:
    latest = await session.scalar(select(func.max(Adapter.version)).where(Adapter.policy_id == policy_id))
    return 0 if latest is None else int(latest) + 1


async def get_adapter(session: AsyncSession, policy_id: int, version: int) -> AdapterInfo | None:
    row = (
        await session.execute(
            select(Adapter).where(Adapter.policy_id == policy_id, Adapter.version == version)
        )
    ).scalar_one_or_none()
    return _adapter(row) if row is not None else None


async def list_adapters(session: AsyncSession, policy_id: int) -> list[AdapterInfo]:
    rows = (
        (
            await session.execute(
                select(Adapter).where(Adapter.policy_id == policy_id).order_by(Adapter.version)
            )
        )
        .scalars()
        .all()
    )
    return [_adapter(r) for r in rows]


async def activate_version(session: AsyncSession, policy_id: int, version: int) -> None:
    """Make `version` the one `model="<policy>"` resolves to; the previous active one becomes `retired`. It serves
    from now on (`mark_serving`), as soon as each gateway's next policy refresh sees it."""
    await session.execute(
        update(Adapter)
        .where(Adapter.policy_id == policy_id, Adapter.status == "active", Adapter.version != version)
        .values(status="retired")
    )
    await session.execute(
        update(Adapter)
        .where(Adapter.policy_id == policy_id, Adapter.version == version)
        .values(status="active")
    )
    await session.execute(update(Policy).where(Policy.id == policy_id).values(active_version=version))
    await mark_serving(session, policy_id, version)


async def mark_serving(
    session: AsyncSession, policy_id: int, version: int, at: datetime | None = None
) -> None:
    """Record that `version` serves traffic from `at` (None: now), unless it already did: `serving_since` keeps
    the first time, so a version rolled back to still counts from when it first served. The time from a reward
    to the version trained on it serving is measured to here (`storage.learning_latency`)."""
    await session.execute(
        update(Adapter)
        .where(Adapter.policy_id == policy_id, Adapter.version == version, Adapter.serving_since.is_(None))
        .values(serving_since=at or datetime.now(UTC))
    )


async def promote(session: AsyncSession, policy_name: str, version: int) -> PolicyInfo:
    """Make an existing version active. A row update: every gateway notices it on its next policy refresh."""
    policy = await get_policy(session, policy_name)
    if policy is None:
        raise LookupError(f"no policy named {policy_name!r}")
    if await get_adapter(session, policy.id, version) is None:
        raise LookupError(f"policy {policy_name!r} has no version {version}")
    await activate_version(session, policy.id, version)
    await session.commit()
    promoted = await get_policy(session, policy_name)
    assert promoted is not None
    return promoted


async def rollback(session: AsyncSession, policy_name: str) -> PolicyInfo:
    """Re-activate the version that was active before the current one (the newest retired version below it)."""
    policy = await get_policy(session, policy_name)
    if policy is None:
        raise LookupError(f"no policy named {policy_name!r}")
    retired = [
        a.version
        for a in await list_adapters(session, policy.id)
        if a.status == "retired" and (policy.active_version is None or a.version < policy.active_version)
    ]
    if not retired:
        raise LookupError(f"policy {policy_name!r} has no earlier version to roll back to")
    return await promote(session, policy_name, max(retired))
