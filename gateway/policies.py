"""Creating policies: a database row plus version 0, an initialised LoRA with zero effect, so the loop can start.

Used by `kaizen policy create` and `POST /admin/policies`. The configuration is validated whole before anything
is written. Building version 0 loads the base model with torch, so it runs in a worker thread when called from
the server.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from gateway.base_models import resolve_base_model
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
)
from trainer.control.policy_config import TrainConfig, load_policy_config

log = logging.getLogger(__name__)


class BaseModelUnavailable(ValueError):
    """The base model named for a new policy could not be loaded: a client's mistake, answered with a 400."""


def build_initial_adapter(base_path: str, target: Path, train_config: TrainConfig) -> None:
    """Save a fresh LoRA for the base model. PEFT initialises B to zero, so it changes nothing yet.

    torch and the trainer's model code are imported here: the gateway itself installs and starts without them.
    """
    import torch

    from trainer.learner.model import load_policy, save_adapter

    if target.exists():
        return  # an earlier, interrupted create got this far: the directory is complete (it is renamed in)
    try:
        model, _ = load_policy(base_path, None, train_config, torch.device("cpu"))
    except (OSError, ValueError) as exc:  # transformers' answers for no such model, directory or hub id
        raise BaseModelUnavailable(
            f"base model {_clip(base_path)!r} could not be loaded: {_clip(str(exc))}"
        ) from exc
    save_adapter(model, target)


def _clip(text: str, limit: int = 300) -> str:
    """At most `limit` characters of `text`: a 70 kB name is echoed back by the loader, and by the 400."""
    return text if len(text) <= limit else text[:limit] + "..."


async def create_policy_with_initial_adapter(
    database: Database,
    data_dir: Path,
    name: str,
    base_model: str,
    config: dict[str, Any] | None = None,
    *,
    actor: str,
    exist_ok: bool = False,
) -> PolicyInfo:
    """Create policy `name` on `base_model` with version 0 active, recorded in the audit log as `actor`'s
    (with its configuration: a scorer's webhook is where trajectories go). Idempotent with `exist_ok`.

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
    log.info("building version 0 of %s at %s", name, target)
    await asyncio.to_thread(build_initial_adapter, base_path, target, validated.train)
    async with database.session() as session:
        policy = await create_policy(session, name, base_model, config)
        await add_adapter(session, policy.id, 0, str(target.resolve()), status="active")
        await activate_version(session, policy.id, 0)
        await record_audit(
            session, actor, "policy.create", name, {"base_model": base_model, "config": config}
        )
        await session.commit()
        created = await get_policy(session, name)
    assert created is not None
    log.info("policy %s created on %s; version 0 is active", name, base_model)
    return created
