"""Rollouts and version pins: which versions of a policy serve beside its active one, and to whom.

A rollout puts one version on trial next to the active version: a `canary` serves a share of the policy's
traffic and is promoted or rolled back by the canary monitor (`trainer.control.canary`) on live evidence, a
`split` serves a share set by hand and ends only by hand, and a `shadow` answers copies of calls that nobody sees.
A policy runs at most one rollout at a time. A pin serves one project's, or one key's, calls from a fixed version,
whatever is active or on trial. Gateways read both on their policy refresh (`gateway.routing`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from sqlalchemy import delete, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from storage.audit import record_audit
from storage.models import Adapter, Policy, Rollout, VersionPin
from storage.policies import PolicyInfo, activate_version, get_adapter, get_policy, mark_serving

RolloutMode = Literal["canary", "split", "shadow"]
ROLLOUT_MODES: tuple[RolloutMode, ...] = ("canary", "split", "shadow")
PinScope = Literal["project", "key"]
PIN_SCOPES: tuple[PinScope, ...] = ("project", "key")
#: How a rollout ended: its version promoted to every call, rolled back (the version is marked rejected), or
#: stopped by hand with nothing changed.
ENDINGS = ("promoted", "rolled_back", "stopped")


@dataclass(frozen=True)
class RolloutInfo:
    id: int
    policy: str
    policy_id: int
    mode: str
    version: int
    baseline_version: int | None
    share: float
    status: str
    run_id: int | None
    config: dict[str, Any]
    stats: dict[str, Any]
    reason: str | None
    actor: str
    started_at: datetime
    decided_at: datetime | None

    @property
    def running(self) -> bool:
        return self.status == "running"


@dataclass(frozen=True)
class PinInfo:
    policy: str
    scope: str
    subject: str
    version: int
    actor: str
    created_at: datetime


class RolloutRefused(ValueError):
    """A rollout or pin that cannot be set as asked; `param` names the field at fault, `code` the reason."""

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def _rollout(row: Rollout, policy: str) -> RolloutInfo:
    return RolloutInfo(
        row.id,
        policy,
        row.policy_id,
        row.mode,
        row.version,
        row.baseline_version,
        row.share,
        row.status,
        row.run_id,
        dict(row.config or {}),
        dict(row.stats or {}),
        row.reason,
        row.actor,
        row.started_at,
        row.decided_at,
    )


async def _servable(session: AsyncSession, policy_name: str, version: int) -> PolicyInfo:
    """The policy, whose `version` may serve: `LookupError` when either is unknown, `RolloutRefused` when
    the version was rejected (by the gate or a rollback)."""
    policy = await get_policy(session, policy_name)
    if policy is None:
        raise LookupError(f"no policy named {policy_name!r}")
    adapter = await get_adapter(session, policy.id, version)
    if adapter is None:
        raise LookupError(f"policy {policy_name!r} has no version {version}")
    if adapter.status == "rejected":
        raise RolloutRefused(f"version {version} was rejected", param="version", code="version_rejected")
    return policy


async def start_rollout(
    session: AsyncSession,
    policy_name: str,
    version: int,
    *,
    mode: RolloutMode,
    share: float,
    actor: str,
    run_id: int | None = None,
    config: dict[str, Any] | None = None,
) -> RolloutInfo:
    """Put `version` on trial beside the active version (flushed, not committed; audited in the same
    transaction). Raises `LookupError` for an unknown policy or version, `RolloutRefused` for what cannot be
    tried: the active version itself, a rejected version, a policy without an active version, a share outside
    (0, 1], or a policy that already runs a rollout."""
    if mode not in ROLLOUT_MODES:
        raise RolloutRefused(f"mode must be one of {', '.join(ROLLOUT_MODES)}", param="mode")
    if not 0 < share <= 1:
        raise RolloutRefused("share must be above 0 and at most 1", param="share")
    policy = await _servable(session, policy_name, version)
    if policy.active_version is None:
        raise RolloutRefused(
            f"policy {policy_name!r} has no active version to compare with; promote one instead",
            param="version",
            code="no_active_version",
        )
    if version == policy.active_version:
        raise RolloutRefused(f"version {version} is the active version", param="version")
    running = await running_rollout(session, policy_name)
    if running is not None:
        raise RolloutRefused(
            f"policy {policy_name!r} already runs a {running.mode} of version {running.version} (rollout "
            f"{running.id}); end it first",
            code="rollout_running",
        )
    now = datetime.now(UTC)
    row = Rollout(
        policy_id=policy.id,
        mode=mode,
        version=version,
        baseline_version=policy.active_version,
        share=share,
        status="running",
        run_id=run_id,
        config=config or {},
        stats={},
        actor=actor,
        started_at=now,
    )
    session.add(row)
    await session.flush()
    if mode != "shadow":
        await mark_serving(session, policy.id, version, now)
    details = {"rollout": row.id, "mode": mode, "version": version, "baseline": policy.active_version}
    await record_audit(
        session, actor, "rollout.start", policy_name, {**details, "share": share, "run": run_id}
    )
    return _rollout(row, policy_name)


async def end_rollout(
    session: AsyncSession,
    rollout_id: int,
    status: str,
    *,
    reason: str,
    actor: str,
    stats: dict[str, Any] | None = None,
) -> RolloutInfo:
    """End a running rollout (flushed, not committed; audited): `promoted` makes its version active,
    `rolled_back` marks it rejected, `stopped` changes nothing that serves. Raises `LookupError` when there is no
    such rollout and `RolloutRefused` when it has already ended."""
    if status not in ENDINGS:
        raise ValueError(f"a rollout ends as one of {ENDINGS}, not {status!r}")
    found = (
        await session.execute(
            select(Rollout, Policy.name)
            .join(Policy, Policy.id == Rollout.policy_id)
            .where(Rollout.id == rollout_id)
        )
    ).one_or_none()
    if found is None:
        raise LookupError(f"no rollout {rollout_id}")
    row, policy = found
    if row.status != "running":
        raise RolloutRefused(f"rollout {rollout_id} already ended ({row.status})", code="rollout_ended")
    values: dict[str, Any] = {"status": status, "reason": reason, "decided_at": datetime.now(UTC)}
    if stats is not None:
        values["stats"] = stats
    # Only while still running: two replicas' monitors deciding at once, one ends it and the other is refused.
    ended = await session.execute(
        update(Rollout).where(Rollout.id == rollout_id, Rollout.status == "running").values(**values)
    )
    if not ended.rowcount:  # type: ignore[attr-defined]
        raise RolloutRefused(f"rollout {rollout_id} already ended", code="rollout_ended")
    await session.refresh(row)
    if status == "promoted":
        await activate_version(session, row.policy_id, row.version)
    elif status == "rolled_back":
        await session.execute(
            update(Adapter)
            .where(Adapter.policy_id == row.policy_id, Adapter.version == row.version)
            .values(status="rejected")
        )
    await session.flush()
    details = {"rollout": row.id, "mode": row.mode, "version": row.version, "reason": reason}
    await record_audit(session, actor, f"rollout.{status}", policy, details)
    return _rollout(row, policy)


async def record_evaluation(session: AsyncSession, rollout_id: int, stats: dict[str, Any]) -> None:
    """Keep the monitor's latest numbers on the rollout (what the dashboard and /metrics show while it runs)."""
    await session.execute(update(Rollout).where(Rollout.id == rollout_id).values(stats=stats))


def _rollouts() -> Any:
    return select(Rollout, Policy.name).join(Policy, Policy.id == Rollout.policy_id)


async def running_rollouts(session: AsyncSession) -> list[RolloutInfo]:
    """Every policy's running rollout."""
    rows = await session.execute(_rollouts().where(Rollout.status == "running").order_by(Rollout.id))
    return [_rollout(row, name) for row, name in rows]


async def running_rollout(session: AsyncSession, policy: str) -> RolloutInfo | None:
    rows = await session.execute(_rollouts().where(Rollout.status == "running", Policy.name == policy))
    found = rows.first()
    return _rollout(found[0], found[1]) if found is not None else None


async def get_rollout(session: AsyncSession, rollout_id: int) -> RolloutInfo | None:
    found = (await session.execute(_rollouts().where(Rollout.id == rollout_id))).first()
    return _rollout(found[0], found[1]) if found is not None else None


async def list_rollouts(session: AsyncSession, policy: str, limit: int = 50) -> list[RolloutInfo]:
    """The policy's rollouts, newest first."""
    rows = await session.execute(
        _rollouts().where(Policy.name == policy).order_by(Rollout.id.desc()).limit(limit)
    )
    return [_rollout(row, name) for row, name in rows]


async def set_pin(
    session: AsyncSession, policy_name: str, scope: PinScope, subject: str, version: int, *, actor: str
) -> PinInfo:
    """Serve `scope` `subject`'s calls to the policy from `version` (replacing an earlier pin of the same subject;
    flushed and audited). Raises `LookupError` for an unknown policy or version, `RolloutRefused` for a rejected
    version or an unknown scope."""
    if scope not in PIN_SCOPES:
        raise RolloutRefused(f"scope must be one of {', '.join(PIN_SCOPES)}", param="scope")
    policy = await _servable(session, policy_name, version)
    await session.execute(
        delete(VersionPin).where(
            VersionPin.policy_id == policy.id, VersionPin.scope == scope, VersionPin.subject == subject
        )
    )
    row = VersionPin(
        policy_id=policy.id,
        scope=scope,
        subject=subject,
        version=version,
        actor=actor,
        created_at=datetime.now(UTC),
    )
    session.add(row)
    await session.flush()
    await mark_serving(session, policy.id, version)
    await record_audit(
        session, actor, "pin.set", policy_name, {"scope": scope, "subject": subject, "version": version}
    )
    return PinInfo(policy_name, scope, subject, version, actor, row.created_at)


async def remove_pin(
    session: AsyncSession, policy_name: str, scope: str, subject: str, *, actor: str
) -> bool:
    """Drop a pin (audited); False when there was none."""
    policy = await get_policy(session, policy_name)
    if policy is None:
        raise LookupError(f"no policy named {policy_name!r}")
    removed = await session.execute(
        delete(VersionPin).where(
            VersionPin.policy_id == policy.id, VersionPin.scope == scope, VersionPin.subject == subject
        )
    )
    if not removed.rowcount:  # type: ignore[attr-defined]
        return False
    await record_audit(session, actor, "pin.remove", policy_name, {"scope": scope, "subject": subject})
    return True


async def list_pins(session: AsyncSession, policy: str | None = None) -> list[PinInfo]:
    """Pins of one policy, or of every policy."""
    query = select(VersionPin, Policy.name).join(Policy, Policy.id == VersionPin.policy_id)
    if policy is not None:
        query = query.where(Policy.name == policy)
    rows = await session.execute(query.order_by(Policy.name, VersionPin.scope, VersionPin.subject))
    return [PinInfo(name, p.scope, p.subject, p.version, p.actor, p.created_at) for p, name in rows]
