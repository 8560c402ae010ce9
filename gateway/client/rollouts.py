"""`gather`: run a rollout function several times per scenario, concurrently, with a progress bar.

Each attempt gets its own `Trajectory` (its own episode) in the scenario's `TrajectoryGroup`, so the gateway
can compare the attempts: RULER judges them side by side and GRPO learns from how their rewards differ.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from tqdm import tqdm  # type: ignore[import-untyped]

from gateway.client.trajectories import Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from gateway.client.model import Model

logger = logging.getLogger(__name__)

S = TypeVar("S")
#: A rollout: runs one attempt at a scenario through the trajectory's client, and returns its reward (or sets
#: `trajectory.reward` itself, or leaves it None for a scorer such as RULER).
Rollout = Callable[[Trajectory, S], Awaitable[float | None]]


class RolloutsFailed(RuntimeError):
    """More rollouts raised than `max_failures` allows; the groups (with their failures) are attached."""

    def __init__(self, failed: int, total: int, groups: list[TrajectoryGroup]) -> None:
        first = next(t.error for g in groups for t in g.failures)
        super().__init__(f"{failed} of {total} rollouts failed; the first: {first!r}")
        self.groups = groups


async def gather(
    model: Model,
    rollout: Rollout[S],
    scenarios: Sequence[S],
    *,
    attempts: int = 4,
    concurrency: int = 8,
    group_keys: Sequence[str] | None = None,
    max_failures: int = 0,
    desc: str | None = None,
    progress: bool = True,
) -> list[TrajectoryGroup]:
    """`attempts` rollouts of each scenario, at most `concurrency` at once; one group per scenario, in order.

    Group keys default to `<8 random hex>-<index>`, new for every call, so a second gather of the same scenarios
    makes new groups. A rollout that raises is kept out of its group (in `group.failures`); more than
    `max_failures` of them raise `RolloutsFailed` once every rollout has finished.
    """
    if attempts < 1 or concurrency < 1:
        raise ValueError("attempts and concurrency must be at least 1")
    if group_keys is None:
        prefix = uuid.uuid4().hex[:8]
        group_keys = [f"{prefix}-{index}" for index in range(len(scenarios))]
    if len(group_keys) != len(scenarios):
        raise ValueError("one group key per scenario")
    groups = [TrajectoryGroup(key, scenario) for key, scenario in zip(group_keys, scenarios, strict=True)]
    limit = asyncio.Semaphore(concurrency)
    total = len(scenarios) * attempts
    bar = tqdm(
        total=total, desc=desc or f"{model.name} rollouts", unit="rollout", disable=None if progress else True
    )
    rewards: list[float] = []

    async def run(group: TrajectoryGroup, trajectory: Trajectory) -> None:
        async with limit:
            try:
                reward = await rollout(trajectory, group.scenario)
                if reward is not None:
                    trajectory.reward = float(reward)
            except Exception as exc:  # one rollout failing must not lose the others' episodes
                trajectory.error = exc
                logger.warning("rollout %s of group %s failed: %r", trajectory.episode_id, group.key, exc)
        if trajectory.reward is not None and trajectory.error is None:
            rewards.append(trajectory.reward)
            bar.set_postfix(reward=f"{sum(rewards) / len(rewards):.3f}", refresh=False)
        bar.update(1)

    try:
        pairs = [(g, model.trajectory(g.key)) for g in groups for _ in range(attempts)]
        await asyncio.gather(*(run(group, trajectory) for group, trajectory in pairs))
    finally:
        bar.close()
    for group, trajectory in pairs:
        (group.failures if trajectory.error is not None else group.trajectories).append(trajectory)
    failed = sum(len(g.failures) for g in groups)
    if failed > max_failures:
        raise RolloutsFailed(failed, total, groups)
    return groups
