"""`/admin/policies/{name}/rollouts` and `/pins`: canaries, splits and shadows, and versions pinned for a project
or a key (admin key). Gateways route by them from their next policy refresh (`KAIZEN_POLICY_REFRESH_S`)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

import msgspec
from litestar import Controller, Request, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, JSONBody
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.auth import principal_of, requires
from gateway.controllers.params import PageLimit, PathName, RowId, Version
from gateway.errors import Conflict, InvalidRequest, NotFound, invalid_policy_config, policy_not_found
from gateway.rollouts import begin_rollout
from storage.policies import get_policy
from storage.rollouts import (
    PinInfo,
    RolloutInfo,
    RolloutRefused,
    end_rollout,
    get_rollout,
    list_pins,
    list_rollouts,
    remove_pin,
    set_pin,
)
from trainer.control.policy_config import InvalidPolicyConfig

Share = Annotated[float, msgspec.Meta(gt=0, le=1)]


class StartRollout(msgspec.Struct, forbid_unknown_fields=True):
    """Put `version` on trial: a `canary` decided by the monitor, a `split` decided by hand, or a `shadow`."""

    version: Version
    share: Share
    mode: Literal["canary", "split", "shadow"] = "canary"
    #: Keys of the policy's `rollout` section that differ for this rollout (alpha, margin, max_hours …).
    rule: dict[str, Any] = {}


class EndRollout(msgspec.Struct, forbid_unknown_fields=True):
    status: Literal["promoted", "rolled_back", "stopped"]
    reason: str = ""


class SetPin(msgspec.Struct, forbid_unknown_fields=True):
    scope: Literal["project", "key"]
    subject: Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[^\x00-\x1f\x7f]+$")]
    version: Version


class RolloutView(msgspec.Struct):
    id: int
    policy: str
    mode: str
    version: int
    baseline_version: int | None
    share: float
    status: str
    run_id: int | None
    rule: dict[str, Any]
    stats: dict[str, Any]
    reason: str | None
    actor: str
    started_at: datetime
    decided_at: datetime | None


class PinView(msgspec.Struct):
    policy: str
    scope: str
    subject: str
    version: int
    actor: str
    created_at: datetime


def rollout_view(r: RolloutInfo) -> RolloutView:
    return RolloutView(
        r.id,
        r.policy,
        r.mode,
        r.version,
        r.baseline_version,
        r.share,
        r.status,
        r.run_id,
        r.config,
        r.stats,
        r.reason,
        r.actor,
        r.started_at,
        r.decided_at,
    )


def _pin_view(p: PinInfo) -> PinView:
    return PinView(p.policy, p.scope, p.subject, p.version, p.actor, p.created_at)


def _refused(exc: RolloutRefused) -> Conflict | InvalidRequest:
    if exc.code in ("rollout_running", "rollout_ended"):
        return Conflict(str(exc), code=exc.code)
    return InvalidRequest(str(exc), param=exc.param, code=exc.code)


def _missing(exc: LookupError, name: str) -> NotFound:
    message = str(exc).strip("'\"")
    if "no policy" in message:
        return NotFound(message, param="name", code="policy_not_found")
    return NotFound(message, param="version", code="version_not_found")


class RolloutsController(Controller):
    path = "/admin/policies"
    guards = [requires("admin")]  # noqa: RUF012

    @get("/{name:str}/rollouts")
    async def list_rollouts(
        self,
        name: FromPath[PathName],
        session: NamedDependency[AsyncSession],
        limit: FromQuery[PageLimit] = 50,
    ) -> list[RolloutView]:
        """The policy's rollouts, newest first, each with the monitor's latest evaluation in `stats`."""
        if await get_policy(session, name) is None:
            raise policy_not_found(name)
        return [rollout_view(r) for r in await list_rollouts(session, name, limit)]

    @post("/{name:str}/rollouts", status_code=201)
    async def start(
        self,
        request: Request[Any, Any, Any],
        name: FromPath[PathName],
        data: JSONBody[StartRollout],
        session: NamedDependency[AsyncSession],
    ) -> RolloutView:
        """Start a canary, split or shadow of `version` beside the active version. 409 while another runs."""
        try:
            rollout = await begin_rollout(
                session,
                name,
                data.version,
                mode=data.mode,
                share=data.share,
                actor=principal_of(request).actor,
                overrides=data.rule,
            )
        except InvalidPolicyConfig as exc:
            raise invalid_policy_config(exc, param="rule") from exc
        except RolloutRefused as exc:
            raise _refused(exc) from exc
        except LookupError as exc:
            raise _missing(exc, name) from exc
        return rollout_view(rollout)

    @post("/{name:str}/rollouts/{rollout_id:int}/end", status_code=200)
    async def end(
        self,
        request: Request[Any, Any, Any],
        name: FromPath[PathName],
        rollout_id: FromPath[RowId],
        data: JSONBody[EndRollout],
        session: NamedDependency[AsyncSession],
    ) -> RolloutView:
        """End a running rollout by hand: promote its version, roll it back (the version is rejected), or stop."""
        found = await get_rollout(session, rollout_id)
        if found is None or found.policy != name:
            raise NotFound(
                f"policy {name!r} has no rollout {rollout_id}", param="rollout_id", code="rollout_not_found"
            )
        try:
            ended = await end_rollout(
                session,
                rollout_id,
                data.status,
                reason=data.reason or "by hand",
                actor=principal_of(request).actor,
            )
        except RolloutRefused as exc:
            raise _refused(exc) from exc
        await session.commit()
        return rollout_view(ended)

    @get("/{name:str}/pins")
    async def pins(self, name: FromPath[PathName], session: NamedDependency[AsyncSession]) -> list[PinView]:
        if await get_policy(session, name) is None:
            raise policy_not_found(name)
        return [_pin_view(p) for p in await list_pins(session, name)]

    @post("/{name:str}/pins", status_code=200)
    async def pin(
        self,
        request: Request[Any, Any, Any],
        name: FromPath[PathName],
        data: JSONBody[SetPin],
        session: NamedDependency[AsyncSession],
    ) -> PinView:
        """Serve a project's (`scope: project`) or a key's (`scope: key`, its id) calls from `version`."""
        try:
            pinned = await set_pin(
                session, name, data.scope, data.subject, data.version, actor=principal_of(request).actor
            )
        except RolloutRefused as exc:
            raise _refused(exc) from exc
        except LookupError as exc:
            raise _missing(exc, name) from exc
        await session.commit()
        return _pin_view(pinned)

    @delete("/{name:str}/pins/{pin_scope:str}/{subject:str}", status_code=204)
    async def unpin(
        self,
        request: Request[Any, Any, Any],
        name: FromPath[PathName],
        pin_scope: FromPath[PathName],
        subject: FromPath[PathName],
        session: NamedDependency[AsyncSession],
    ) -> None:
        """Drop a pin: the project's or key's calls follow the active version (and any trial) again."""
        scope = pin_scope
        try:
            removed = await remove_pin(session, name, scope, subject, actor=principal_of(request).actor)
        except LookupError as exc:
            raise _missing(exc, name) from exc
        if not removed:
            raise NotFound(
                f"policy {name!r} has no pin for {scope} {subject!r}", param="subject", code="pin_not_found"
            )
        await session.commit()
