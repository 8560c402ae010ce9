"""`/admin/policies`: create and list policies (admin key)."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Controller, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody

from gateway.auth import require_admin_key
from gateway.controllers.params import PathName, PolicyName, Version
from gateway.errors import InvalidRequest, NotFound
from gateway.policies import create_policy_with_initial_adapter
from gateway.settings import Settings
from storage.database import Database
from storage.policies import PolicyExists, list_adapters, list_policies, promote, rollback


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


async def _view(database: Database, name: str | None = None) -> list[PolicyView]:
    async with database.session() as session:
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
    guards = [require_admin_key]  # noqa: RUF012

    @get("")
    async def list_all(self, database: NamedDependency[Database]) -> list[PolicyView]:
        """Every policy with its versions, their status and metrics."""
        return await _view(database)

    @post("", status_code=201)
    async def create(
        self,
        data: JSONBody[CreatePolicy],
        database: NamedDependency[Database],
        settings: NamedDependency[Settings],
    ) -> PolicyView:
        """Create a policy; version 0 (a zero-effect LoRA) is built and made active."""
        try:
            await create_policy_with_initial_adapter(
                database, settings.data_dir, data.name, data.base_model or settings.base_model, data.config
            )
        except (PolicyExists, ValueError) as exc:
            raise InvalidRequest(str(exc), param="name", code="policy_exists") from exc
        [view] = await _view(database, data.name)
        return view

    @post("/{name:str}/promote", status_code=200)
    async def promote(
        self, name: FromPath[PathName], data: JSONBody[Promote], database: NamedDependency[Database]
    ) -> PolicyView:
        """Make a version active; gateways switch new calls to it within `KAIZEN_POLICY_REFRESH_S`."""
        async with database.session() as session:
            try:
                await promote(session, name, data.version)
            except LookupError as exc:
                raise NotFound(str(exc), param="version", code="version_not_found") from exc
        [view] = await _view(database, name)
        return view

    @post("/{name:str}/rollback", status_code=200)
    async def rollback(self, name: FromPath[PathName], database: NamedDependency[Database]) -> PolicyView:
        """Re-activate the previously active version (it stays loadable, so this is instant)."""
        async with database.session() as session:
            try:
                await rollback(session, name)
            except LookupError as exc:
                raise NotFound(str(exc), param="name", code="no_previous_version") from exc
        [view] = await _view(database, name)
        return view
