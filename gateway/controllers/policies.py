"""`/admin/policies`: create and list policies and set their owner (admin key). Their promote, rollback, pause and
resume are `gateway.controllers.policy_actions`, shared with the dashboard."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Controller, Request, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.auth import principal_of, requires
from gateway.body_depth import refuse_too_deep
from gateway.controllers.params import PathName, PolicyName
from gateway.errors import InvalidRequest, NotFound, invalid_policy_config
from gateway.policies import (
    BaseModelUnavailable,
    InvalidOwner,
    check_policy_urls,
    create_policy_with_initial_adapter,
    policy_owner,
)
from gateway.settings import Settings
from storage.audit import record_audit
from storage.database import Database
from storage.policies import PolicyExists, get_policy, list_adapters, list_policies, set_policy_owner
from trainer.control.policy_config import InvalidPolicyConfig


class CreatePolicy(msgspec.Struct, forbid_unknown_fields=True):
    name: PolicyName
    base_model: str | None = None
    config: dict[str, Any] = {}
    #: The project that owns it; neither this nor `shared`: the creating key's project.
    project: str | None = None
    #: Every project's keys call it and it trains on every project's episodes.
    shared: bool = False


class SetOwner(msgspec.Struct, forbid_unknown_fields=True):
    """`{"project": "shop"}` gives the policy to a project, `{"shared": true}` shares it."""

    project: str | None = None
    shared: bool = False


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
    project: str | None  # the owner: only its keys call the policy, only its episodes train it
    shared: bool  # no owner: every project's keys and episodes


class CreatedPolicy(PolicyView):
    """A new policy, with what the admin should know about its configuration (an unsigned webhook, say)."""

    warnings: list[str] = msgspec.field(default_factory=list)


async def policy_views(session: AsyncSession, name: str | None = None) -> list[PolicyView]:
    views = []
    for policy in await list_policies(session):
        if name is not None and policy.name != name:
            continue
        versions = [
            AdapterView(a.version, a.status, a.path, a.parent_version, a.metrics)
            for a in await list_adapters(session, policy.id)
        ]
        views.append(
            PolicyView(
                policy.name,
                policy.base_model,
                policy.active_version,
                policy.config,
                versions,
                policy.project,
                policy.shared,
            )
        )
    return views


class PoliciesController(Controller):
    path = "/admin/policies"
    guards = [requires("admin")]  # noqa: RUF012

    @get("")
    async def list_all(self, session: NamedDependency[AsyncSession]) -> list[PolicyView]:
        """Every policy with its versions, their status and metrics."""
        return await policy_views(session)

    @post("", status_code=201)
    async def create(
        self,
        request: Request[Any, Any, Any],
        data: JSONBody[CreatePolicy],
        database: NamedDependency[Database],
        session: NamedDependency[AsyncSession],
        settings: NamedDependency[Settings],
    ) -> CreatedPolicy:
        """Create a policy; version 0 (a zero-effect LoRA) is built and made active.

        It belongs to `project`, or to the creating key's project when the body names none, unless `shared` is
        true: only the owner's keys call it and only the owner's episodes train it.

        The whole `config` is validated first: a 400 names every unknown key and bad value (a webhook or judge
        URL that is not http(s), or reaches a private address without the operator's opt-in), nothing is written.
        `warnings` says what was accepted but deserves a look.
        """
        refuse_too_deep({"config": data.config}, param="config")
        principal = principal_of(request)
        try:
            owner = policy_owner(data.project, data.shared, principal.project)
        except InvalidOwner as exc:
            raise InvalidRequest(str(exc), param="project", code="invalid_value") from exc
        # Built in sessions of its own (the CLI shares it); a concurrent create of the same name loses on the
        # unique key and is answered 409 by the app.
        try:
            warnings = await check_policy_urls(
                data.config,
                private_networks=settings.outbound_private_networks,
                signed=bool(settings.feedback_secret),
            )
            await create_policy_with_initial_adapter(
                database,
                settings.data_dir,
                data.name,
                data.base_model or settings.base_model,
                data.config,
                actor=principal.actor,
                project=owner,
            )
        except InvalidPolicyConfig as exc:
            raise invalid_policy_config(exc) from exc
        except BaseModelUnavailable as exc:
            raise InvalidRequest(str(exc), param="base_model", code="base_model_unavailable") from exc
        except PolicyExists as exc:
            raise InvalidRequest(str(exc), param="name", code="policy_exists") from exc
        except ValueError as exc:  # a name that cannot be a directory of the adapter store
            raise InvalidRequest(str(exc), param="name", code="invalid_value") from exc
        [view] = await policy_views(session, data.name)
        return CreatedPolicy(**msgspec.structs.asdict(view), warnings=warnings)

    @post("/{name:str}/owner", status_code=200)
    async def set_owner(
        self,
        request: Request[Any, Any, Any],
        name: FromPath[PathName],
        data: JSONBody[SetOwner],
        session: NamedDependency[AsyncSession],
    ) -> PolicyView:
        """Give the policy to a project (`project`) or share it (`shared: true`); one of the two is required.

        Training and judging follow at once: an owned policy's next run reads its owner's episodes only.
        Gateways refuse other projects' calls from their next policy refresh (`KAIZEN_POLICY_REFRESH_S`)."""
        if data.project is None and not data.shared:
            raise InvalidRequest("give `project` or `shared: true`", param="project", code="invalid_value")
        try:
            owner = policy_owner(data.project, data.shared, "")
        except InvalidOwner as exc:
            raise InvalidRequest(str(exc), param="project", code="invalid_value") from exc
        policy = await get_policy(session, name)
        if policy is None:
            raise NotFound(f"no policy named {name!r}", param="name", code="policy_not_found")
        await set_policy_owner(session, policy.id, owner)
        await record_audit(
            session,
            principal_of(request).actor,
            "policy.owner",
            name,
            {"from_project": policy.project, "project": owner, "shared": owner is None},
        )
        await session.commit()
        [view] = await policy_views(session, name)
        return view
