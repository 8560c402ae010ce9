"""Which engine model serves a request's `model`: engine models as they are, policies by adapter version.

`model="support-bot"` goes to the policy's active version, `model="support-bot@7"` pins version 7, and the
engine's own models (the base model) stay addressable. The request path only reads in-memory state; a
background task refreshes it from the engine and the policies table, loads active versions into the engine as
`policy@N` (a new version is always a new name) and unloads versions that are neither active nor in use. The
same refresh keeps each policy's redactor (its `privacy` section) in memory for the capture path, whatever the
engine, and each policy's owner: a policy owned by a project answers another project's keys as if it did not
exist (`admit`). Until that refresh has read the policies once, calls are refused (`PoliciesUnavailable`): a
policy's privacy section is not known yet, and a call stored without it would keep what it should have masked.

A call to a policy by its bare name may be served by another version than the active one (`assign`): a pin of
its key, then of its project, wins; otherwise a running canary or split takes its share of calls, chosen by a
hash of the call's sticky key (its `user`, else its episode), so one user's or one conversation's calls stay
on one version. The version that served is what the call is stored with, so rewards, however late, count for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
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
from storage.rollouts import list_pins, running_rollouts
from trainer.control.policy_config import PrivacyConfig

log = logging.getLogger(__name__)

_PINNED = re.compile(r"^(?P<policy>.+)@(?P<version>\d+)$")


@dataclass(frozen=True)
class Route:
    engine_model: str  # the name the engine knows
    policy: str | None  # the policy (or plain model) the call is stored under
    adapter_version: int | None
    adapter_path: str | None = None
    #: Called by the policy's bare name: `assign` may serve it from a pinned or trial version instead.
    by_name: bool = False


@dataclass(frozen=True)
class Trial:
    """A running rollout's version and the share of the policy's calls it serves (a shadow: answers copies of)."""

    rollout_id: int
    mode: str
    version: int
    share: float


@dataclass
class PolicyState:
    active_version: int | None
    versions: dict[int, str] = field(default_factory=dict)  # version -> adapter directory
    trial: Trial | None = None
    pins: dict[tuple[str, str], int] = field(default_factory=dict)  # (scope, subject) -> version

    def serving(self) -> set[int]:
        """Versions that may serve calls by the policy's name: kept loaded in the engine."""
        versions = {v for v in self.pins.values() if v in self.versions}
        if self.active_version is not None:
            versions.add(self.active_version)
        if self.trial is not None and self.trial.version in self.versions:
            versions.add(self.trial.version)
        return versions


def trial_bucket(rollout_id: int, sticky: str) -> float:
    """Where `sticky` falls in [0, 1) for one rollout: stable for the rollout, independent between rollouts."""
    digest = hashlib.sha256(f"{rollout_id}:{sticky}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


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
            return self._adapter_route(model, policy.active_version, policy, by_name=True)
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

    def assign(self, route: Route, principal: Principal, sticky: str) -> Route:
        """The version that serves a call by the policy's name: the key's pin, the project's pin, the trial
        version for calls whose sticky key falls in its share, else the active version (`route` as it is)."""
        if not route.by_name or route.policy is None:
            return route
        state = self.policies.get(route.policy)
        if state is None:
            return route
        if state.pins:
            for subject in (("key", principal.key_id), ("project", principal.project)):
                version = state.pins.get(subject)
                if version is not None and version in state.versions:
                    return self._adapter_route(route.policy, version, state)
        trial = state.trial
        if (
            trial is not None
            and trial.mode != "shadow"
            and trial.version in state.versions
            and trial_bucket(trial.rollout_id, sticky) < trial.share
        ):
            return self._adapter_route(route.policy, trial.version, state)
        return route

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
    def _adapter_route(policy: str, version: int, state: PolicyState, *, by_name: bool = False) -> Route:
        return Route(adapter_name(policy, version), policy, version, state.versions[version], by_name)

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
                if self.database is not None:
                    for rollout in await running_rollouts(session):
                        if rollout.policy in fresh:
                            trial = Trial(rollout.id, rollout.mode, rollout.version, rollout.share)
                            fresh[rollout.policy].trial = trial
                    for pin in await list_pins(session):
                        if pin.policy in fresh:
                            fresh[pin.policy].pins[(pin.scope, pin.subject)] = pin.version
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
            if old is not None and old.trial != state.trial:
                log.info("policy %s: trial %s -> %s", name, old.trial, state.trial)
        # Load every version that may serve before switching to it, so no call waits on a load.
        for name, state in fresh.items():
            for version in sorted(state.serving()):
                try:
                    await self.engine.load_adapter(adapter_name(name, version), state.versions[version])
                except Exception as exc:
                    log.error("could not load %s@%s: %s", name, version, exc)
                    old = self.policies.get(name)
                    if version == state.active_version:
                        if old is not None:
                            state.active_version = old.active_version
                    elif state.trial is not None and version == state.trial.version:
                        state.trial = old.trial if old is not None else None
                    else:
                        state.pins = {k: v for k, v in state.pins.items() if v != version}
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
        active = {adapter_name(n, version) for n, s in self.policies.items() for version in s.serving()}
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
