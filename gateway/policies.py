"""Creating policies: a database row plus version 0, an initialised LoRA with zero effect, so the loop can start.

Used by `kaizen policy create` and `POST /admin/policies`. A policy is owned by one project unless it is created
`shared` (`policy_owner`): only that project's keys call it, and it trains only on that project's episodes
(`storage.policies.episodes_of`). The configuration is validated whole before anything is written, the addresses
its URLs reach included (`check_policy_urls`). Building version 0 loads the base model with torch: a child
process does it (`trainer.learner.initial_adapter`), so the serving process never holds torch or the base
model's weights.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from gateway.base_models import hub_model_problem, local_directory, resolve_base_model
from storage.audit import record_audit
from storage.database import Database
from storage.models import POLICY_NAME_LENGTH
from storage.policies import (
    PolicyExists,
    PolicyInfo,
    activate_version,
    adapter_dir,
    add_adapter,
    create_policy,
    get_policy,
    set_policy_owner,
)
from trainer.control.model_jobs import (
    BASE_MODEL_UNAVAILABLE,
    InitialAdapterJob,
    clip,
    module_command,
    run_model_job,
)
from trainer.control.outbound import RESOLVE_TIMEOUT_S, address_problem
from trainer.control.policy_config import ConfigProblem, InvalidPolicyConfig, TrainConfig, load_policy_config

log = logging.getLogger(__name__)

#: The child that builds version 0. Tests point it at a script of their own.
INITIAL_ADAPTER_COMMAND: tuple[str, ...] = module_command("trainer.learner.initial_adapter")


class BaseModelUnavailable(ValueError):
    """The base model named for a new policy could not be loaded: a client's mistake, answered with a 400."""


class InvalidOwner(ValueError):
    """A policy's owner that cannot be: both a project and `shared`, or a project name no key could have."""


def policy_owner(project: str | None, shared: bool, creator: str) -> str | None:
    """The project that owns a new policy (None: shared by every project). Sharing is never a default: it is
    asked for (`shared`), and a policy that names no project belongs to `creator`'s (the creating key's project;
    the built-in project for the CLI, the project of the environment's keys)."""
    if shared:
        if project is not None:
            raise InvalidOwner("a policy is either owned by a project or shared: give `project` or `shared`")
        return None
    owner = creator if project is None else project
    if not owner or len(owner) > 128 or any(ord(c) < 32 or ord(c) == 127 for c in owner):
        raise InvalidOwner("project must be 1-128 characters without control characters")
    return owner


async def change_policy_owner(
    session: AsyncSession, name: str, project: str | None, shared: bool, actor: str
) -> str | None:
    """Give the policy `name` to `project`, or share it (`shared`), with an audit record; returns the new owner
    (None: shared). Raises `InvalidOwner` unless exactly one of the two is given well, and `LookupError` for a
    policy that does not exist. The caller commits."""
    if project is None and not shared:
        raise InvalidOwner("give a project or share the policy: `project` or `shared`")
    owner = policy_owner(project, shared, "")
    policy = await get_policy(session, name)
    if policy is None:
        raise LookupError(f"no policy named {name!r}")
    await set_policy_owner(session, policy.id, owner)
    details = {"from_project": policy.project, "project": owner, "shared": owner is None}
    await record_audit(session, actor, "policy.owner", name, details)
    return owner


async def check_policy_urls(
    config: Mapping[str, Any] | None, *, private_networks: bool, signed: bool
) -> list[str]:
    """Check the URLs a new policy's configuration sends trajectories to (its scoring webhook, its judge's
    `api_base`) before anything is written; `private_networks`: KAIZEN_OUTBOUND_PRIVATE_NETWORKS, `signed`:
    whether KAIZEN_FEEDBACK_SECRET is set.

    Raises `InvalidPolicyConfig` for a bad configuration, and for a URL whose host resolves to a non-global
    address without the opt-in. Returns the warnings, each logged: a webhook called unsigned, a name that does not
    resolve now (the scorer resolves it again at every call and refuses it then if it must)."""
    rewards = load_policy_config(config).rewards
    problems: list[ConfigProblem] = []
    warnings: list[str] = []
    urls = (
        ("rewards.scorer.webhook_url", rewards.scorer.webhook_url),
        ("rewards.judge.api_base", rewards.judge.api_base),
    )
    for path, url in urls:
        if url is None or private_networks:
            continue
        try:
            problem = await asyncio.wait_for(address_problem(url), RESOLVE_TIMEOUT_S)
        except (OSError, TimeoutError) as exc:
            warnings.append(
                f"{path}: {url} does not resolve now ({exc or 'timed out'}); it is checked at every call"
            )
            continue
        if problem is not None:
            problems.append(ConfigProblem(path, problem))
    if problems:
        raise InvalidPolicyConfig(problems)
    if rewards.scorer.kind == "webhook" and not signed:
        warnings.append(
            "rewards.scorer.webhook_url: KAIZEN_FEEDBACK_SECRET is not set, so trajectories are posted to the "
            "webhook unsigned and it cannot tell Kaizen's requests from anyone else's"
        )
    for warning in warnings:
        log.warning("policy configuration: %s", warning)
    return warnings


async def build_initial_adapter(base_path: str, target: Path, train_config: TrainConfig) -> None:
    """Save a fresh LoRA for the base model at `target`, in a child process (`trainer.learner.initial_adapter`):
    the base model and torch are loaded there, never in the serving process, whose event loop goes on serving.

    A `target` that exists is kept: an earlier, interrupted create got that far (the directory is renamed in
    once complete). Raises `BaseModelUnavailable` when the loader refuses the base model; nothing is written
    then."""
    job = InitialAdapterJob(
        base_model=base_path,
        target=str(target),
        train=train_config.model_dump(mode="json"),
        log_level=logging.getLogger().getEffectiveLevel(),
    )
    outcome = await run_model_job(INITIAL_ADAPTER_COMMAND, job, f"building version 0 at {target}")
    if outcome.status == BASE_MODEL_UNAVAILABLE:
        raise BaseModelUnavailable(f"base model {clip(base_path)!r} could not be loaded: {outcome.reason}")


async def create_policy_with_initial_adapter(
    database: Database,
    data_dir: Path,
    name: str,
    base_model: str,
    config: dict[str, Any] | None = None,
    *,
    actor: str,
    project: str | None = None,
    exist_ok: bool = False,
) -> PolicyInfo:
    """Create policy `name` on `base_model` with version 0 active, owned by `project` (None: shared; the callers
    that face users decide with `policy_owner`), recorded in the audit log as `actor`'s (with its configuration:
    a scorer's webhook is where trajectories go, and its owner). Idempotent with `exist_ok`.

    Raises `InvalidPolicyConfig` (naming every problem) for a bad `config`; it is stored as given, so keys
    it leaves out keep following the defaults. Raises `BaseModelUnavailable` when the base model cannot be
    loaded; nothing is written then."""
    config = config or {}
    validated = load_policy_config(config)
    async with database.session() as session:
        existing = await get_policy(session, name)
    if existing is not None:
        if exist_ok:
            return existing
        raise PolicyExists(f"policy {name!r} already exists")
    bad = "@" in name or "/" in name or not name.strip() or name in (".", "..")
    if bad or len(name) > POLICY_NAME_LENGTH:
        # Its versions live at adapters/<name>/<version>: the name must be one step below adapters/, and fit
        # the policies' name column (checked before version 0 is built).
        raise ValueError(
            f"a policy name must be 1 to {POLICY_NAME_LENGTH} characters, contain neither '@' nor '/', "
            "and not be '.' or '..'"
        )
    base_path = await asyncio.to_thread(resolve_base_model, base_model, data_dir / "models")
    target = adapter_dir(data_dir, name, 0)
    # A version 0 an interrupted create left complete is kept without loading the base model, so only a build
    # to come needs a base model it can load.
    if not target.exists() and local_directory(base_path) is None:
        problem = await asyncio.to_thread(hub_model_problem, base_path)
        if problem is not None:
            raise BaseModelUnavailable(f"base model {clip(base_path)!r} could not be loaded: {clip(problem)}")
    log.info("building version 0 of %s at %s", name, target)
    await build_initial_adapter(base_path, target, validated.train)
    async with database.session() as session:
        policy = await create_policy(session, name, base_model, config, project=project)
        await add_adapter(session, policy.id, 0, str(target.resolve()), status="active")
        await activate_version(session, policy.id, 0)
        await record_audit(
            session,
            actor,
            "policy.create",
            name,
            {"base_model": base_model, "config": config, "project": project, "shared": project is None},
        )
        await session.commit()
        created = await get_policy(session, name)
    assert created is not None
    log.info(
        "policy %s created on %s, %s; version 0 is active",
        name,
        base_model,
        "shared by every project" if project is None else f"owned by project {project!r}",
    )
    return created
