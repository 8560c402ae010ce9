"""`/admin/policies`: create and list policies (admin key)."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Controller, Request, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.auth import principal_of, requires
from gateway.body_depth import refuse_too_deep
from gateway.controllers.params import PathName, PolicyName, Version
from gateway.errors import InvalidRequest, NotFound, invalid_policy_config
from gateway.policies import BaseModelUnavailable, create_policy_with_initial_adapter
from gateway.settings import Settings
from storage.audit import record_audit
from storage.database import Database
from storage.policies import PolicyExists, get_policy, list_adapters, list_policies, promote, rollback
from trainer.control.policy_config import InvalidPolicyConfig


class CreatePolicy(msgspec.Struct, forbid_unknown_fields=True):
    name: PolicyName
    base_model: str | None = None
    config: dict[str, Any] = {}


class Promote(msgspec.Struct, forbid_unknown_fields=True):
    version: Version


class AdapterView(msgspec.Struct):
    version: int
    status: str
    path: str
    parent_version: int | None
    metrics: dict[str, Any]


class PolicyView(msgspec.Struct):
    name: str
    base_model: str
    active_version: int | None
    config: dict[str, Any]
    versions: list[AdapterView]


async def _view(session: AsyncSession, name: str | None = None) -> list[PolicyView]:
    views = []
    for policy in await list_policies(session):
        if name is not None and policy.name != name:
            continue
        versions = [
            AdapterView(a.version, a.status, a.path, a.parent_version, a.metrics)
            for a in await list_adapters(session, policy.id)
        ]
        views.append(
            PolicyView(policy.name, policy.base_model, policy.active_version, policy.config, versions)
        )
    return views


class PoliciesController(Controller):
    path = "/admin/policies"
    guards = [requires("admin")]  # noqa: RUF012

    @get("")
    async def list_all(self, session: NamedDependency[AsyncSession]) -> list[PolicyView]:
        """Every policy with its versions, their status and metrics."""
        return await _view(session)

    @post("", status_code=201)
    async def create(
        self,
        request: Request[Any, Any, Any],
        data: JSONBody[CreatePolicy],
        database: NamedDependency[Database],
        session: NamedDependency[AsyncSession],
        settings: NamedDependency[Settings],
    ) -> PolicyView:
        """Create a policy; version 0 (a zero-effect LoRA) is built and made active.

        The whole `config` is validated first: a 400 names every unknown key and bad value, nothing is written.
        """
        refuse_too_deep({"config": data.config}, param="config")
        # Built in sessions of its own (the CLI shares it); a concurrent create of the same name loses on the
        # unique key and is answered 409 by the app.
        try:
            await create_policy_with_initial_adapter(
                database,
                settings.data_dir,
                data.name,
                data.base_model or settings.base_model,
                data.config,
                actor=principal_of(request).actor,
            )
        except InvalidPolicyConfig as exc:
            raise invalid_policy_config(exc) from exc
        except BaseModelUnavailable as exc:
            raise InvalidRequest(str(exc), param="base_model", code="base_model_unavailable") from exc
        except PolicyExists as exc:
            raise InvalidRequest(str(exc), param="name", code="policy_exists") from exc
        except ValueError as exc:  # a name that cannot be a directory of the adapter store
            raise InvalidRequest(str(exc), param="name", code="invalid_value") from exc
        [view] = await _view(session, data.name)
        return view

    @post("/{name:str}/promote", status_code=200)
    async def promote(
        self,
        request: Request[Any, Any, Any],
        name: FromPath[PathName],
        data: JSONBody[Promote],
        session: NamedDependency[AsyncSession],
    ) -> PolicyView:
        """Make a version active; gateways switch new calls to it within `KAIZEN_POLICY_REFRESH_S`."""
        return await promote_version(session, principal_of(request).actor, name, data.version)

    @post("/{name:str}/rollback", status_code=200)
    async def rollback(
        self,
        request: Request[Any, Any, Any],
        name: FromPath[PathName],
        session: NamedDependency[AsyncSession],
    ) -> PolicyView:
        """Re-activate the previously active version (it stays loadable, so this is instant)."""
        return await roll_back(session, principal_of(request).actor, name)


async def promote_version(session: AsyncSession, actor: str, name: str, version: int) -> PolicyView:
    """Promote `version` of policy `name`, audited as `actor` (the admin API and the dashboard)."""
    if await get_policy(session, name) is None:
        raise _no_policy(name)
    # Added first: `promote` commits, and a refusal rolls the entry back with the session.
    await record_audit(session, actor, "policy.promote", name, {"version": version})
    try:
        await promote(session, name, version)
    except LookupError as exc:
        raise NotFound(str(exc), param="version", code="version_not_found") from exc
    [view] = await _view(session, name)
    return view


async def roll_back(session: AsyncSession, actor: str, name: str) -> PolicyView:
    """Re-activate the version active before the current one, audited as `actor`."""
    current = await get_policy(session, name)
    if current is None:
        raise _no_policy(name)
    await record_audit(
        session,
        actor,
        "policy.rollback",
        name,
        {"from_version": current.active_version},
    )
    try:
        await rollback(session, name)
    except LookupError as exc:
        raise NotFound(str(exc), param="name", code="no_previous_version") from exc
    [view] = await _view(session, name)
    return view


def _no_policy(name: str) -> NotFound:
    return NotFound(f"no policy named {name!r}", param="name", code="policy_not_found")
