"""GRPO groups: several attempts at the same task, whose rewards are compared with each other.

* ``key``: episodes sharing the client's ``group_key``;
* ``prompt``: episodes with the identical context up to the first assistant turn (``calls.context_hash``);
* ``resample`` (default for production traffic, where a prompt is usually seen once): each selected trajectory
  is the first member of its own group; k-1 more replies to the same context (everything before its final
  assistant turn) are sampled from the active adapter (through the serving engine, `trainer.engine_sampling`, or
  the trainer's own copy) and scored by the policy's scorer, while the original keeps its own reward; RULER,
  which judges replies relative to each other, sees the original too. In multi-turn episodes with tool results
  only the final assistant turn is resampled: re-running the earlier turns would need the tools, which only the
  client can call.

Groups whose rewards do not vary are skipped and counted: their advantages are all zero.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import polars as pl

from storage.episodes import Trajectory
from trainer.advantages import group_advantages, has_signal
from trainer.dataset import DataReport, TrainingExample
from trainer.policy_config import TrainConfig
from trainer.scoring import Scorer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sample:
    """One sampled reply with the exact tokens and the behaviour logprobs of the sampler."""

    text: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] | None


class Sampler(Protocol):
    """Draws replies from the active adapter (the trainer's own model, or the serving engine)."""

    #: How many contexts may be sampled at once: the engine batches concurrent requests, a local model cannot.
    max_concurrency: int

    async def sample(
        self, messages: list[dict[str, Any]], tools: list[Any] | None, n: int
    ) -> list[Sample]: ...


class ReplyScorer(Protocol):
    """Scores generated replies to one context (reward function, scoring webhook or RULER); None = unscored.

    `original` is the captured reply the group started from: it keeps its own reward, but a relative judge
    needs it in the group to put the new replies on the same scale.
    """

    async def score(
        self, context: list[dict[str, Any]], replies: list[str], original: dict[str, Any]
    ) -> list[float | None]: ...


@dataclass(frozen=True)
class Group:
    """Attempts at one task with their group-relative advantages (same order as `members`)."""

    key: str
    members: list[TrainingExample]
    advantages: list[float]

    @property
    def rewards(self) -> list[float]:
        return [m.reward for m in self.members]


def _finalise(key: str, members: list[TrainingExample], cfg: TrainConfig, report: DataReport) -> Group | None:
    rewards = [m.reward for m in members]
    if len(members) < cfg.min_group_size:
        report.add("groups_too_small")
        report.add("trajectories_in_small_groups", len(members))
        return None
    if not has_signal(rewards):
        report.add("groups_no_variance")
        report.add("trajectories_in_flat_groups", len(members))
        return None
    return Group(key, members, group_advantages(rewards, scale_by_std=cfg.scale_by_std))


def group_by_column(
    trajectories: Sequence[TrainingExample], cfg: TrainConfig, report: DataReport
) -> list[Group]:
    """`key` and `prompt` grouping: trajectories sharing group_key, or context_hash."""
    column = "group_key" if cfg.grouping == "key" else "context_hash"
    frame = pl.DataFrame(
        {"index": list(range(len(trajectories))), "key": [getattr(t, column) for t in trajectories]},
        schema={"index": pl.Int64, "key": pl.String},
    )
    missing = frame.filter(pl.col("key").is_null()).height
    report.add(f"dropped_no_{column}", missing)
    grouped = frame.drop_nulls("key").group_by("key", maintain_order=True).agg(pl.col("index")).sort("key")
    groups = []
    for key, indices in grouped.iter_rows():
        group = _finalise(key, [trajectories[i] for i in indices], cfg, report)
        if group is not None:
            groups.append(group)
    return groups


async def resample_groups(
    trajectories: Sequence[TrainingExample],
    cfg: TrainConfig,
    sampler: Sampler,
    scorer: ReplyScorer,
    report: DataReport,
) -> list[Group]:
    """`resample` grouping: each trajectory plus k-1 fresh replies to its context, scored by `scorer`.

    Up to `resample_concurrency` trajectories are sampled and scored at once (the engine batches them, and a
    judge or webhook answers in parallel); the groups come back in the order of `trajectories`.
    """
    limit = asyncio.Semaphore(max(1, min(cfg.resample_concurrency, sampler.max_concurrency)))
    started = time.monotonic()
    done = 0

    async def resample(trajectory: TrainingExample) -> Group | None:
        nonlocal done
        async with limit:
            samples = await sampler.sample(trajectory.context, trajectory.tools, cfg.group_size - 1)
            scores = await scorer.score(trajectory.context, [s.text for s in samples], trajectory.reply)
        report.add("resampled_replies", len(samples))
        members = [trajectory]
        for sample, score in zip(samples, scores, strict=True):
            if score is None:
                report.add("resampled_unscored")
                continue
            members.append(
                replace(
                    trajectory,
                    reply={"role": "assistant", "content": sample.text},
                    reward=float(score),
                    prompt_token_ids=sample.prompt_token_ids,
                    completion_token_ids=sample.token_ids,
                    completion_logprobs=sample.logprobs,
                    origin="resampled",
                )
            )
        done += 1
        if done % 8 == 0 and done < len(trajectories):
            logger.info(
                "resampled %d/%d groups (%.0f s)", done, len(trajectories), time.monotonic() - started
            )
        return _finalise(trajectory.episode_id, members, cfg, report)

    # A task group: one failure (engine gone) cancels the rest instead of leaving them running; the first
    # failure is raised as itself, not wrapped in an ExceptionGroup.
    try:
        async with asyncio.TaskGroup() as tasks:
            pending = [tasks.create_task(resample(t)) for t in trajectories]
    except ExceptionGroup as failures:
        raise failures.exceptions[0] from None
    logger.info("resampled %d groups in %.0f s", len(trajectories), time.monotonic() - started)
    return [group for task in pending if (group := task.result()) is not None]


def group_stats(groups: Sequence[Group]) -> dict[str, float]:
    """Reward statistics over every trajectory that made it into a group."""
    rewards = [r for g in groups for r in g.rewards]
    if not rewards:
        return {"groups": 0, "trajectories": 0}
    frame = pl.DataFrame({"reward": rewards})
    by_origin: dict[str, int] = defaultdict(int)
    for g in groups:
        for m in g.members:
            by_origin[m.origin] += 1
    return {
        "groups": len(groups),
        "trajectories": len(rewards),
        "captured_trajectories": by_origin["captured"],
        "resampled_trajectories": by_origin["resampled"],
        "reward_mean": float(frame["reward"].mean()),  # type: ignore[arg-type]
        "reward_std": float(frame["reward"].std(ddof=0)),  # type: ignore[arg-type]
    }


class PolicyReplyScorer:
    """Adapts the policy's configured scorer (function, webhook or RULER) to score resampled replies.

    Each reply becomes a trajectory `context + [reply]`; a scorer failure leaves the whole batch unscored
    (counted), never stops the run. RULER (source `judge`) scores relative to the group, so it judges the
    original reply along with the new ones and the original's score is discarded: it keeps its own reward.
    """

    def __init__(self, inner: Scorer, policy: str) -> None:
        self.inner = inner
        self.policy = policy

    async def score(
        self, context: list[dict[str, Any]], replies: list[str], original: dict[str, Any]
    ) -> list[float | None]:
        trajectories = [
            Trajectory(
                episode_id=f"resample-{i}",
                messages=[*context, {"role": "assistant", "content": reply}],
                policy=self.policy,
            )
            for i, reply in enumerate(replies)
        ]
        judged = list(trajectories)
        if self.inner.source == "judge":
            judged.insert(
                0, Trajectory(episode_id="original", messages=[*context, original], policy=self.policy)
            )
        outcome = await self.inner.score(judged)
        if outcome.scores is None:
            logger.warning("scorer failed on resampled replies: %s", outcome.error)
            return [None] * len(replies)
        by_id = {s.episode_id: s.value for s in outcome.scores}
        return [by_id.get(t.episode_id) for t in trajectories]
