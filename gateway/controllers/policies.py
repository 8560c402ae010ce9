"""`/admin/policies`: create and list policies, set their owner and compare their versions' live reward (admin
key). Their promote, rollback, pause and
resume are `gateway.controllers.policy_actions`, shared with the dashboard."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

import msgspec
from litestar import Controller, Request, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, JSONBody, Parameter
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.auth import principal_of, requires
from gateway.body_depth import refuse_too_deep
from gateway.controllers.params import ROW_ID_MAX, PathName, PolicyName
from gateway.errors import InvalidRequest, NotFound, invalid_policy_config, policy_not_found
from gateway.policies import (
    BaseModelUnavailable,
    InvalidOwner,
    change_policy_owner,
    check_policy_urls,
    create_policy_with_initial_adapter,
    policy_owner,
)
from gateway.settings import Settings
from storage.database import Database
from storage.policies import PolicyExists, list_adapters, list_policies
from storage.version_rewards import (
    CONFIDENCE,
    UnknownVersion,
    VersionReward,
    compare_version_rewards,
    policy_version_rewards,
)
from trainer.control.policy_config import InvalidPolicyConfig

VersionParam = Annotated[int, Parameter(ge=0, le=ROW_ID_MAX)]
"""An adapter version in a query string."""


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


class VersionRewardView(msgspec.Struct):
    """The rewarded episodes a version served (by their first call) and their mean reward's 95% interval."""

    version: int | None  # None: the base model
    status: str | None
    episodes: int
    mean: float | None
    std: float | None  # sample standard deviation; None below two episodes
    ci_low: float | None  # None below two episodes
    ci_high: float | None


class VersionRewards(msgspec.Struct):
    policy: str
    since: datetime | None
    confidence: float
    versions: list[VersionRewardView]


class DifferenceView(msgspec.Struct):
    """Mean reward of b minus that of a and its 95% interval (Welch); `excludes_zero`: a real difference."""

    diff: float | None
    ci_low: float | None
    ci_high: float | None
    excludes_zero: bool


class VersionComparison(msgspec.Struct):
    policy: str
    since: datetime | None
    confidence: float
    a: VersionRewardView
    b: VersionRewardView
    difference: DifferenceView


def version_reward_view(row: VersionReward) -> VersionRewardView:
    s = row.stats
    return VersionRewardView(row.version, row.status, s.episodes, s.mean, s.std, s.low, s.high)


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
        try:
            await change_policy_owner(session, name, data.project, data.shared, principal_of(request).actor)
        except InvalidOwner as exc:
            raise InvalidRequest(str(exc), param="project", code="invalid_value") from exc
        except LookupError as exc:
            raise policy_not_found(name) from exc
        await session.commit()
        [view] = await policy_views(session, name)
        return view

    @get("/{name:str}/versions/rewards")
    async def version_rewards(
        self,
        name: FromPath[PathName],
        session: NamedDependency[AsyncSession],
        since: FromQuery[datetime | None] = None,
    ) -> VersionRewards:
        """Live reward of every version: the rewarded episodes each served (by their first call) since `since`
        (ISO 8601, UTC when it has no offset; default all time), their mean, standard deviation and 95%
        interval. Admin keys see every project's episodes, as on the other admin routes."""
        rows = await policy_version_rewards(session, name, since)
        if rows is None:
            raise policy_not_found(name)
        return VersionRewards(name, since, CONFIDENCE, [version_reward_view(row) for row in rows])

    @get("/{name:str}/versions/compare")
    async def compare_versions(
        self,
        name: FromPath[PathName],
        a: FromQuery[VersionParam],
        b: FromQuery[VersionParam],
        session: NamedDependency[AsyncSession],
        since: FromQuery[datetime | None] = None,
    ) -> VersionComparison:
        """Live reward of versions `a` and `b` and the difference b - a with its 95% interval (Welch);
        `excludes_zero` when the interval lies on one side of 0. 404 for an unknown policy or version."""
        try:
            compared = await compare_version_rewards(session, name, a, b, since)
        except UnknownVersion as exc:
            raise NotFound(str(exc), param=exc.param, code="version_not_found") from exc
        if compared is None:
            raise policy_not_found(name)
        first, second, found = compared
        return VersionComparison(
            name,
            since,
            CONFIDENCE,
            version_reward_view(first),
            version_reward_view(second),
            DifferenceView(found.diff, found.low, found.high, found.significant),
        )
