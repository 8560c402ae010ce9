"""Promote, roll back, pause and resume a policy: declared once, registered twice.

The admin API serves them under /admin/policies (an admin key) and the dashboard under /dashboard/policies
(a dashboard session with its CSRF token). The router each registration sits on brings the guard, and the
dashboard's its security headers; the actor in the audit log is whoever that guard authenticated.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Controller, Request, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.auth import principal_of
from gateway.controllers.params import PathName, Version
from gateway.controllers.policies import PolicyView, policy_views
from gateway.errors import NotFound, invalid_policy_config, policy_not_found
from gateway.rollouts import settle_after_switch
from gateway.scheduling import Jobs
from storage.audit import record_audit
from storage.policies import get_policy, promote, rollback, update_policy_config
from trainer.control.policy_config import InvalidPolicyConfig, load_policy_config


class Promote(msgspec.Struct, forbid_unknown_fields=True):
    version: Version


class ScheduleView(msgspec.Struct):
    policy: str
    schedule: dict[str, Any]


class PolicyActions(Controller):
    path = "/policies"

    @post("/{name:str}/promote", status_code=200)
    async def promote(
        self,
        request: Request[Any, Any, Any],
        name: FromPath[PathName],
        data: JSONBody[Promote],
        session: NamedDependency[AsyncSession],
    ) -> PolicyView:
        """Make a version active; gateways switch new calls to it within `KAIZEN_POLICY_REFRESH_S`."""
        if await get_policy(session, name) is None:
            raise policy_not_found(name)
        # Added first: `promote` commits, and a refusal rolls the entry back with the session.
        await record_audit(
            session, principal_of(request).actor, "policy.promote", name, {"version": data.version}
        )
        try:
            await promote(session, name, data.version)
        except LookupError as exc:
            raise NotFound(str(exc), param="version", code="version_not_found") from exc
        await settle_after_switch(session, name, data.version, principal_of(request).actor)
        await session.commit()
        [view] = await policy_views(session, name)
        return view

    @post("/{name:str}/rollback", status_code=200)
    async def rollback(
        self,
        request: Request[Any, Any, Any],
        name: FromPath[PathName],
        session: NamedDependency[AsyncSession],
    ) -> PolicyView:
        """Re-activate the previously active version (it stays loadable, so this is instant)."""
        current = await get_policy(session, name)
        if current is None:
            raise policy_not_found(name)
        await record_audit(
            session,
            principal_of(request).actor,
            "policy.rollback",
            name,
            {"from_version": current.active_version},
        )
        try:
            switched = await rollback(session, name)
        except LookupError as exc:
            raise NotFound(str(exc), param="name", code="no_previous_version") from exc
        await settle_after_switch(session, name, switched.active_version, principal_of(request).actor)
        await session.commit()
        [view] = await policy_views(session, name)
        return view

    @post("/{name:str}/pause", status_code=200)
    async def pause(
        self,
        request: Request[Any, Any, Any],
        name: FromPath[PathName],
        session: NamedDependency[AsyncSession],
        jobs: NamedDependency[Jobs],
    ) -> ScheduleView:
        """Stop the policy's scheduled jobs (manual runs still work)."""
        return await _set_paused(session, jobs, principal_of(request).actor, name, True)

    @post("/{name:str}/resume", status_code=200)
    async def resume(
        self,
        request: Request[Any, Any, Any],
        name: FromPath[PathName],
        session: NamedDependency[AsyncSession],
        jobs: NamedDependency[Jobs],
    ) -> ScheduleView:
        """Restart the policy's scheduled jobs."""
        return await _set_paused(session, jobs, principal_of(request).actor, name, False)


async def _set_paused(session: AsyncSession, jobs: Jobs, actor: str, name: str, paused: bool) -> ScheduleView:
    policy = await get_policy(session, name)
    if policy is None:
        raise policy_not_found(name)
    try:
        schedule = load_policy_config(policy.config).schedule
    except InvalidPolicyConfig as exc:
        raise invalid_policy_config(exc) from exc
    stored = {**dict(policy.config.get("schedule") or {}), "paused": paused}
    await update_policy_config(session, policy.id, {**policy.config, "schedule": stored})
    action = "policy.pause" if paused else "policy.resume"
    await record_audit(session, actor, action, name)
    await session.commit()  # before the scheduler re-reads the schedules, in sessions of its own
    await jobs.sync()
    return ScheduleView(name, schedule.model_copy(update={"paused": paused}).model_dump(mode="json"))
