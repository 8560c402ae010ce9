"""The training reward of an episode, derived from its signals by the policy's rule (see `RewardRule`).

Signals are rewards rows: explicit feedback, reward-function and webhook scores, RULER judgements. The rule is
configuration; the derived value is stored on the episode with its provenance (rule, the rewards used, and
their values), so a training batch can always say where a reward came from.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from storage.episodes import episode_policies, set_episode_reward
from storage.policies import get_policy
from storage.rewards import RewardInfo, rewards_for_episodes
from storage.rollups import mark_changed
from trainer.control.policy_config import RewardConfig, RewardRule, load_policy_config


def _latest_per_name(signals: Iterable[RewardInfo]) -> dict[str, RewardInfo]:
    """The newest signal of each `source:name`: a corrected thumb replaces the earlier one."""
    latest: dict[str, RewardInfo] = {}
    for signal in sorted(signals, key=lambda s: (s.created_at, s.id)):
        latest[f"{signal.source}:{signal.name}"] = signal
    return latest


def derive_reward(signals: Sequence[RewardInfo], rule: RewardRule) -> tuple[float, dict[str, Any]] | None:
    """(reward, provenance) of an episode with these signals, or None when the rule finds nothing to use."""
    latest = _latest_per_name(signals)
    if rule.kind == "priority":
        for source in rule.priority:
            used = [s for key, s in latest.items() if key.split(":", 1)[0] == source]
            if used:
                value = sum(s.value for s in used) / len(used)
                return value, {
                    "rule": "priority",
                    "source": source,
                    "terms": [{"reward_id": s.id, "name": s.name, "value": s.value} for s in used],
                }
        return None
    terms: list[dict[str, Any]] = []
    total = weight_sum = 0.0
    for term, weight in rule.weights.items():
        matching = [s for key, s in latest.items() if key == term or key.split(":", 1)[0] == term]
        if not matching:
            continue
        value = sum(s.value for s in matching) / len(matching)
        total += weight * value
        weight_sum += abs(weight)
        terms.append({"term": term, "weight": weight, "value": value, "reward_ids": [s.id for s in matching]})
    if not terms:
        return None
    if rule.normalize and weight_sum > 0:
        total /= weight_sum
    return total, {"rule": "weighted", "normalized": rule.normalize, "terms": terms}


async def policy_reward_config(session: AsyncSession, policy: str | None) -> RewardConfig:
    """The policy's reward configuration, or the defaults when it has no row (e.g. a plain upstream model).

    The whole configuration is validated: a policy whose stored configuration is invalid raises
    `InvalidPolicyConfig` here too, as everywhere else it is read."""
    info = await get_policy(session, policy) if policy else None
    return load_policy_config(info.config if info is not None else None).rewards


async def refresh_episode_rewards(
    session: AsyncSession, episode_ids: Iterable[str]
) -> dict[str, float | None]:
    """Re-derive and store the reward of these episodes from all their signals (the caller commits)."""
    ids = sorted(set(episode_ids))
    if not ids:
        return {}
    policies = await episode_policies(session, ids)
    signals = await rewards_for_episodes(session, list(policies))
    configs: dict[str | None, RewardConfig] = {}
    derived: dict[str, float | None] = {}
    started: list[datetime] = []
    for episode_id, policy in policies.items():
        if policy not in configs:
            configs[policy] = await policy_reward_config(session, policy)
        result = derive_reward(signals.get(episode_id, []), configs[policy].rule)
        value, provenance = result if result is not None else (None, None)
        if (at := await set_episode_reward(session, episode_id, value, provenance)) is not None:
            started.append(at)
        derived[episode_id] = value
    # The dashboard's rollup sums rewards by when their episode started, perhaps long ago.
    await mark_changed(session, started)
    return derived
