"""Which engine model serves a request's `model`: engine models as they are, policies by adapter version.

`model="support-bot"` goes to the policy's active version, `model="support-bot@7"` pins version 7, and the
engine's own models (the base model) stay addressable. The request path only reads in-memory state; a
background task refreshes it from the engine and the policies table, loads active versions into the engine as
`policy@N` (a new version is always a new name) and unloads versions that are neither active nor in use. The
same refresh keeps each policy's redactor (its `privacy` section) in memory for the capture path, whatever the
engine, and each policy's owner: a policy owned by a project answers another project's keys as if it did not
exist (`admit`). Until that refresh has read the policies once, calls are refused (`PoliciesUnavailable`): a
policy's privacy section is not known yet, and a call stored without it would keep what it should have masked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from gateway.auth import Principal
from gateway.engines.base import Engine
from gateway.errors import InvalidRequest, NotFound, ServiceUnavailable
from gateway.redaction import Redactor
from storage.database import Database
from storage.models import POLICY_NAME_LENGTH
from storage.policies import list_adapters, list_policies
from trainer.control.policy_config import PrivacyConfig

log = logging.getLogger(__name__)

_PINNED = re.compile(r"^(?P<policy>.+)@(?P<version>\d+)$")


@dataclass(frozen=True)
class Route:
    engine_model: str  # the name the engine knows
    policy: str | None  # the policy (or plain model) the call is stored under
    adapter_version: int | None
    adapter_path: str | None = None


@dataclass
class PolicyState:
    active_version: int | None
    versions: dict[int, str] = field(default_factory=dict)  # version -> adapter directory


def adapter_name(policy: str, version: int) -> str:
    return f"{policy}@{version}"


class PoliciesUnavailable(ServiceUnavailable):
    """The policies table has not been read since start-up (the database was unreachable)."""

    def __init__(self) -> None:
        super().__init__(
            "The gateway has not read its policies from the database yet; retry shortly.",
            code="policies_unavailable",
            retry_after=2.0,
        )


class ModelRouter:
    """Resolves `model` strings; keeps the engine's loaded adapters in line with the policies table."""

    def __init__(
        self,
        engine: Engine,
        refresh_s: float,
        *,
        database: Database | None = None,
        policy_refresh_s: float = 2.0,
        idle_unload_s: float = 300.0,
        redaction_key: Callable[[], bytes] | None = None,
    ) -> None:
        self.engine = engine
        self.refresh_s = refresh_s
        self.database = database if engine.capabilities.adapters else None
        self.config_database = database
        self.redaction_key = redaction_key
        # policy -> (its stored `privacy` section, the redactor built from it); absent: mode `off`
        self.redactors: dict[str, tuple[Any, Redactor]] = {}
        # every policy the last read saw, redacting or not
        self.known_policies: set[str] = set()
        # policy -> the project that owns it, for the owned ones only
        self.owners: dict[str, str] = {}
        self.policy_refresh_s = policy_refresh_s
        self.idle_unload_s = idle_unload_s
        self.engine_models: set[str] = set()
        self.policies: dict[str, PolicyState] = {}
        self.policies_loaded = database is None  # nothing to read without a database
        self.created = int(time.time())
        self.in_flight: Counter[str] = Counter()
        self.last_used: dict[str, float] = {}
        self._tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------ request path
    def resolve(self, model: str) -> Route:
        if not self.policies_loaded:
            raise PoliciesUnavailable()
        policy = self.policies.get(model)
        if policy is not None:
            if policy.active_version is None or policy.active_version not in policy.versions:
                raise NotFound(
                    f"policy `{model}` has no active version yet", param="model", code="model_not_found"
                )
            return self._adapter_route(model, policy.active_version, policy)
        pinned = _PINNED.match(model)
        if pinned is not None and pinned["policy"] in self.policies:
            version = int(pinned["version"])
            state = self.policies[pinned["policy"]]
            if version not in state.versions:
                raise NotFound(
                    f"policy `{pinned['policy']}` has no version {version}",
                    param="model",
                    code="model_not_found",
                )
            return self._adapter_route(pinned["policy"], version, state)
        if model in self.engine_models or (not self.engine_models and self.database is None):
            # An engine that could not list its models yet decides for itself.
            if len(model) > POLICY_NAME_LENGTH or "\x00" in model:
                # Its calls are stored under the model's name as their policy, a bounded text column.
                raise InvalidRequest(
                    f"A model name of more than {POLICY_NAME_LENGTH} characters, or with NUL characters, "
                    "cannot be captured; serve the model under a shorter name.",
                    param="model",
                    code="invalid_value",
                )
            return Route(model, model, None)
        raise NotFound(
            f"The model `{model}` does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )

    def admit(self, model: str, route: Route, principal: Principal) -> Principal:
        """Who a call to `model` (resolved to `route`) is made and recorded as. A policy owned by a project is
        another project's keys' 404, the answer for a model that does not exist, so they learn nothing of it.
        Admin keys, which see every project, may call it: their call is recorded under the owner, whose
        episodes alone the policy trains on (a bootstrap calls its policy with the admin key)."""
        acting = principal.acting_on(self.owners.get(route.policy) if route.policy is not None else None)
        if acting is not None:
            return acting
        raise NotFound(
            f"The model `{model}` does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )

    def visible(self, name: str, principal: Principal) -> bool:
        """Whether /v1/models shows `name` (a policy, or an engine model) to this key."""
        return principal.acting_on(self.owners.get(name)) is not None

    def redactor(self, policy: str | None) -> Redactor | None:
        """The redactor for calls stored under `policy`, or None when they are stored verbatim."""
        if not self.policies_loaded:
            raise PoliciesUnavailable()
        entry = self.redactors.get(policy) if policy is not None else None
        return entry[1] if entry is not None else None

    async def current_redactor(self, policy: str) -> Redactor | None:
        """As `redactor`, reading the policies first when `policy` is newer than the last read: a tool call made
        through `/mcp/<policy>` right after the policy was created must not be stored verbatim."""
        if policy not in self.known_policies:
            await self.refresh_policies()
            if policy not in self.known_policies:  # the read failed: whether to redact is unknown
                raise PoliciesUnavailable()
        return self.redactor(policy)

    @staticmethod
    def _adapter_route(policy: str, version: int, state: PolicyState) -> Route:
        return Route(adapter_name(policy, version), policy, version, state.versions[version])

    async def acquire(self, route: Route) -> None:
        """Mark a call in flight on `route` (so its adapter is not unloaded) and make sure it is loaded."""
        self.in_flight[route.engine_model] += 1
        self.last_used[route.engine_model] = time.monotonic()
        if route.adapter_path is not None:
            try:
                await self.engine.load_adapter(route.engine_model, route.adapter_path)
            except BaseException:
                self.release(route)
                raise

    def release(self, route: Route) -> None:
        self.in_flight[route.engine_model] -= 1
        if self.in_flight[route.engine_model] <= 0:
            del self.in_flight[route.engine_model]

    def listed(self) -> list[str]:
        names = set(self.engine_models)
        for policy, state in self.policies.items():
            if state.active_version is not None:
                names.add(policy)
        return sorted(names)

    # ------------------------------------------------------------------ background
    async def refresh(self) -> None:
        try:
            self.engine_models = set(await self.engine.list_models())
        except Exception as exc:
            log.warning("could not list the engine's models: %s", exc)

    async def refresh_policies(self) -> None:
        if self.config_database is None:
            return
        try:
            async with self.config_database.session() as session:
                fresh: dict[str, PolicyState] = {}
                privacy: dict[str, Any] = {}
                owners: dict[str, str] = {}
                for policy in await list_policies(session):
                    privacy[policy.name] = policy.config.get("privacy")
                    if policy.project is not None:
                        owners[policy.name] = policy.project
                    if self.database is not None:
                        versions = {a.version: a.path for a in await list_adapters(session, policy.id)}
                        fresh[policy.name] = PolicyState(policy.active_version, versions)
        except Exception as exc:
            log.warning("could not read policies: %s", exc)
            return
        self._refresh_redactors(privacy)
        self.known_policies = set(privacy)
        self.owners = owners
        self.policies_loaded = True
        if self.database is None:
            return
        for name, state in fresh.items():
            old = self.policies.get(name)
            if old is not None and old.active_version != state.active_version:
                log.info("policy %s: active version %s -> %s", name, old.active_version, state.active_version)
        # Load new active versions before switching to them, so no call waits on a load.
        for name, state in fresh.items():
            if state.active_version is not None and state.active_version in state.versions:
                try:
                    await self.engine.load_adapter(
                        adapter_name(name, state.active_version), state.versions[state.active_version]
                    )
                except Exception as exc:
                    log.error("could not load %s@%s: %s", name, state.active_version, exc)
                    if name in self.policies:
                        fresh[name].active_version = self.policies[name].active_version
        self.policies = fresh
        await self._unload_idle()

    def _refresh_redactors(self, sections: dict[str, Any]) -> None:
        """Rebuild the redactors of policies whose `privacy` section changed; keep the rest."""
        redactors: dict[str, tuple[Any, Redactor]] = {}
        for name, section in sections.items():
            old = self.redactors.get(name)
            if old is not None and old[0] == section:
                redactors[name] = old
                continue
            try:
                config = PrivacyConfig.model_validate(section or {})
            except ValidationError as exc:
                log.error("policy %s: invalid privacy section, keeping the previous one: %s", name, exc)
                if old is not None:
                    redactors[name] = old
                continue
            if config.mode == "off":
                continue
            key = b""
            if config.mode == "hash" and self.redaction_key is not None:
                try:
                    key = self.redaction_key()
                except OSError as exc:
                    # No key, no hash: masking still keeps the values out of storage.
                    log.error("policy %s: no redaction key (%s); masking instead of hashing", name, exc)
                    config = config.model_copy(update={"mode": "mask"})
            redactors[name] = (section, Redactor(config, key, policy=name))
            log.info("policy %s: calls are stored with redaction (%s)", name, config.mode)
        self.redactors = redactors

    async def _unload_idle(self) -> None:
        active = {
            adapter_name(n, s.active_version)
            for n, s in self.policies.items()
            if s.active_version is not None
        }
        now = time.monotonic()
        for name in self.engine.loaded_adapters():
            if name in active or self.in_flight.get(name, 0) > 0:
                continue
            if now - self.last_used.get(name, 0.0) < self.idle_unload_s:
                continue
            try:
                await self.engine.unload_adapter(name)
            except Exception as exc:
                log.warning("could not unload %s: %s", name, exc)

    async def start(self) -> None:
        await self.refresh()
        await self.refresh_policies()
        self._tasks = [
            asyncio.create_task(self._every(self.refresh_s, self.refresh), name="model-refresh"),
            asyncio.create_task(
                self._every(self.policy_refresh_s, self.refresh_policies), name="policy-refresh"
            ),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    @staticmethod
    async def _every(seconds: float, job: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(seconds)
            await job()
