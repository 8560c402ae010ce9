"""`/admin/policies`: create and list policies (admin key). Their promote, rollback, pause and resume are
`gateway.controllers.policy_actions`, shared with the dashboard."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Controller, Request, get, post
from litestar.di import NamedDependency
from litestar.params import JSONBody
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.auth import principal_of, requires
from gateway.body_depth import refuse_too_deep
from gateway.controllers.params import PolicyName
from gateway.errors import InvalidRequest, invalid_policy_config
from gateway.policies import BaseModelUnavailable, check_policy_urls, create_policy_with_initial_adapter
from gateway.settings import Settings
from storage.database import Database
from storage.policies import PolicyExists, list_adapters, list_policies
from trainer.control.policy_config import InvalidPolicyConfig


class CreatePolicy(msgspec.Struct, forbid_unknown_fields=True):
    name: PolicyName
    base_model: str | None = None
    config: dict[str, Any] = {}


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
            PolicyView(policy.name, policy.base_model, policy.active_version, policy.config, versions)
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

        The whole `config` is validated first: a 400 names every unknown key and bad value (a webhook or judge
        URL that is not http(s), or reaches a private address without the operator's opt-in), nothing is written.
        `warnings` says what was accepted but deserves a look.
        """
        refuse_too_deep({"config": data.config}, param="config")
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
        [view] = await policy_views(session, data.name)
        return CreatedPolicy(**msgspec.structs.asdict(view), warnings=warnings)
