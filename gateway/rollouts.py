"""Rollouts and pins set by hand: what the admin API (`/admin/policies/{name}/rollouts`, `/pins`) and `kaizen
policy canary|split|shadow|end|pin|unpin` share.

A rollout keeps the decision rule it started under (the policy's `rollout` section with the request's
overrides) in its own row, so changing the policy's section later does not change a trial midway. Promoting or
rolling back a version by hand settles a running rollout: the trial version promoted ends it as promoted, any
other switch of the active version stops it (its baseline is no longer what serves).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from storage.policies import get_policy
from storage.rollouts import RolloutInfo, RolloutMode, end_rollout, running_rollout, start_rollout
from trainer.control.policy_config import RolloutConfig, load_policy_config


def rollout_rule(policy_config: Mapping[str, Any], overrides: Mapping[str, Any]) -> RolloutConfig:
    """The policy's `rollout` section with `overrides` on top; raises `InvalidPolicyConfig` naming what is wrong
    (as `rollout.<key>`)."""
    section = {**dict(policy_config.get("rollout") or {}), **overrides}
    return load_policy_config({**policy_config, "rollout": section}).rollout


async def begin_rollout(
    session: AsyncSession,
    policy: str,
    version: int,
    *,
    mode: RolloutMode,
    share: float,
    actor: str,
    overrides: Mapping[str, Any] | None = None,
) -> RolloutInfo:
    """Start a rollout by hand (committed). Raises `LookupError`, `RolloutRefused` or `InvalidPolicyConfig`."""
    info = await get_policy(session, policy)
    if info is None:
        raise LookupError(f"no policy named {policy!r}")
    rule = rollout_rule(info.config, overrides or {})
    rollout = await start_rollout(
        session, policy, version, mode=mode, share=share, actor=actor, config=rule.model_dump(mode="json")
    )
    await session.commit()
    return rollout


async def settle_after_switch(session: AsyncSession, policy: str, active: int | None, actor: str) -> None:
    """After the active version was switched by hand (not committed): end the policy's running rollout."""
    running = await running_rollout(session, policy)
    if running is None:
        return
    if running.version == active:
        await end_rollout(session, running.id, "promoted", reason="promoted by hand", actor=actor)
    else:
        await end_rollout(
            session,
            running.id,
            "stopped",
            reason=f"the active version was switched to {active} by hand",
            actor=actor,
        )
