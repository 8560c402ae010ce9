"""GRPO groups: several attempts at the same task, whose rewards are compared with each other.

* ``key``: episodes sharing the client's ``group_key``;
* ``prompt``: episodes with the identical context up to the first assistant turn (``calls.context_hash``);
* ``resample`` (default for production traffic, where a task is usually seen once): each selected trajectory
  is the first member of its own group; k-1 more attempts at the same task are rolled out from its start with the
  active adapter (through the serving engine, `trainer.learner.engine_sampling`, or the trainer's own copy) and
  scored by the policy's scorer as whole trajectories, while the original keeps its own reward; RULER, which
  judges trajectories relative to each other, sees the original too. An attempt's start is everything before the
  agent's part of the episode (`trainer.control.rollouts`): for a one-answer episode, the context of its reply;
  for an agent episode, the conversation before its first tool call, which the rollout re-runs with its tools
  (those of the policy's that may be called while training, else the captured results of identical calls).

Groups whose rewards do not vary are skipped and counted: their advantages are all zero.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import polars as pl

from storage.episodes import EpisodeTranscript
from trainer.control.policy_config import TrainConfig
from trainer.control.rollouts import (
    USABLE_ENDINGS,
    Rollout,
    RolloutCounters,
    RolloutTask,
    ToolCaller,
    TurnSampler,
    roll_out,
)
from trainer.control.scoring import Scorer
from trainer.learner.advantages import group_advantages, has_signal
from trainer.learner.dataset import DataReport, TrainingExample, Turn

logger = logging.getLogger(__name__)


class Sampler(TurnSampler, Protocol):
    """Draws assistant turns from the active adapter (the trainer's own model, or the serving engine)."""

    #: How many contexts may be sampled at once: the engine batches concurrent requests, a local model cannot.
    max_concurrency: int


class ReplyScorer(Protocol):
    """Scores attempts at one task as whole conversations (reward function, scoring webhook or RULER); None =
    unscored.

    `original` is the captured conversation the group started from: it keeps its own reward, but a relative judge
    needs it in the group to put the new attempts on the same scale.
    """

    async def score(
        self, conversations: list[list[dict[str, Any]]], original: list[dict[str, Any]]
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


@dataclass(frozen=True)
class Pool:
    """What one context's group holds so far, as `allocate` sees it."""

    #: Captured attempts plus replies drawn so far (an unscored reply counts: it is not drawn again).
    members: int
    has_signal: bool


def allocate(pools: Sequence[Pool], budget: int, group_size: int, max_group_size: int) -> list[int]:
    """How many new replies each context gets in the next resampling round, `budget` in all.

    A context with fewer than `group_size` replies is topped up to it, so every group has a usable baseline.
    After that only a context whose rewards do not vary yet gets more, `group_size` at a time up to
    `max_group_size`: a group where every reply failed (or every one succeeded) teaches nothing, and a single
    success (failure) among more replies makes it count. The budget goes to the contexts with the fewest
    replies first (ties in the given order), so it is spread over many contexts rather than spent on a few.
    """
    wants = []
    for pool in pools:
        if pool.members < group_size:
            wants.append(group_size - pool.members)
        elif not pool.has_signal and pool.members < max_group_size:
            wants.append(min(group_size, max_group_size - pool.members))
        else:
            wants.append(0)
    grants = [0] * len(pools)
    left = max(budget, 0)
    for index in sorted(range(len(pools)), key=lambda i: pools[i].members):
        if left == 0:
            break
        grants[index] = min(wants[index], left)
        left -= grants[index]
    return grants


def _task_key(trajectory: TrainingExample) -> str:
    return json.dumps([trajectory.start, trajectory.tools], sort_keys=True, default=str)


def _by_task(trajectories: Sequence[TrainingExample]) -> list[list[TrainingExample]]:
    """Captured attempts at the identical task (the same start and tools) share a group, first-seen order; each
    is an attempt the engine does not have to draw again."""
    pools: dict[str, list[TrainingExample]] = {}
    for trajectory in trajectories:
        pools.setdefault(_task_key(trajectory), []).append(trajectory)
    return list(pools.values())


def _surprise(members: Sequence[TrainingExample], mean: float) -> float:
    return max(abs(m.reward - mean) for m in members)


def _task_of(members: Sequence[TrainingExample]) -> RolloutTask:
    """The first captured attempt's task, replaying what any captured attempt at it recorded."""
    task = members[0].rollout_task()
    recorded: dict[tuple[str, str], str] = {}
    for member in members:
        for key, value in member.rollout_task().recorded.items():
            recorded.setdefault(key, value)
    return RolloutTask(task.start, task.tools, task.options, recorded)


def attempt(rollout: Rollout, task: RolloutTask, like: TrainingExample, reward: float) -> TrainingExample:
    """A rollout as a group member: its last turn is the final one, the others its earlier turns."""
    turns = [
        Turn(
            context=context,
            reply=turn.message,
            prompt_token_ids=turn.prompt_token_ids,
            completion_token_ids=turn.token_ids,
            completion_logprobs=turn.logprobs,
            options=dict(task.options_at(index)),
        )
        for index, (context, turn) in enumerate(rollout.turns)
    ]
    final = turns[-1]
    return replace(
        like,
        context=final.context,
        reply=final.reply,
        reward=reward,
        prompt_token_ids=final.prompt_token_ids,
        completion_token_ids=final.completion_token_ids,
        completion_logprobs=final.completion_logprobs,
        earlier=turns[:-1],
        options=final.options,
        origin="resampled",
    )


async def resample_groups(
    trajectories: Sequence[TrainingExample],
    cfg: TrainConfig,
    sampler: Sampler,
    scorer: ReplyScorer,
    report: DataReport,
    tools: ToolCaller | None = None,
) -> tuple[list[Group], dict[str, Any]]:
    """`resample` grouping: captured attempts at each task plus fresh rollouts with the active version, scored
    by `scorer`, in rounds planned by `allocate` within `resample_budget` rollouts.

    Where successes are rare most groups of `group_size` have no reward variance and teach nothing; later
    rounds spend the rest of the budget on exactly those. Tasks whose captured reward differs most from the
    window's mean (a rare success, a rare failure) come first when the budget cannot cover every task. Up to
    `resample_concurrency` tasks are rolled out and scored at once (the engine batches them, and a judge or
    webhook answers in parallel). A rollout that reaches a tool call nobody can answer, or whose reply the
    trainer's token cap cut short of the app's own limit, is left out of its group (counted); one cut at the
    app's own limit is scored as the app would have seen it. Returns the groups in first-seen order and what the rounds
    cost and found.
    """
    limit = asyncio.Semaphore(max(1, min(cfg.resample_concurrency, sampler.max_concurrency)))
    started = time.monotonic()
    pools = _by_task(trajectories)
    tasks = [_task_of(members) for members in pools]
    report.add("contexts_merged", len(trajectories) - len(pools))
    mean = sum(t.reward for t in trajectories) / len(trajectories) if trajectories else 0.0
    order = sorted(range(len(pools)), key=lambda i: -_surprise(pools[i], mean))
    budget = cfg.resample_budget
    signal_by_round: list[int] = []
    counters = RolloutCounters()
    tried = [len(members) for members in pools]

    async def resample(index: int, n: int) -> None:
        members = pools[index]
        first, task = members[0], tasks[index]
        tried[index] += n
        async with limit:
            rollouts = await roll_out(task, n, sampler, tools, max_turns=cfg.max_turns)
            for rollout in rollouts:
                counters.add(rollout)
            usable = [r for r in rollouts if r.ending in USABLE_ENDINGS]
            report.add("rollouts_truncated", sum(r.ending == "truncated" for r in rollouts))
            report.add("rollouts_unanswerable", sum(r.ending == "unanswerable" for r in rollouts))
            scores = await scorer.score([r.messages for r in usable], first.messages) if usable else []
        report.add("resampled_replies", len(usable))
        for rollout, score in zip(usable, scores, strict=True):
            if score is None:
                report.add("resampled_unscored")
                continue
            members.append(attempt(rollout, task, first, float(score)))

    while True:
        state = [Pool(tried[i], has_signal([m.reward for m in pools[i]])) for i in order]
        grants = allocate(state, budget, cfg.group_size, cfg.resample_max_group_size)
        if not any(grants):
            break
        budget -= sum(grants)
        # A task group: one failure (engine gone) cancels the rest instead of leaving them running; the first
        # failure is raised as itself, not wrapped in an ExceptionGroup.
        try:
            async with asyncio.TaskGroup() as group_tasks:
                for index, n in zip(order, grants, strict=True):
                    if n:
                        group_tasks.create_task(resample(index, n))
        except ExceptionGroup as failures:
            raise failures.exceptions[0] from None
        signal_by_round.append(sum(1 for p in pools if has_signal([m.reward for m in p])))
        logger.info(
            "resampling round %d: %d rollouts of %d tasks, %d of %d groups have reward variance (%.0f s)",
            len(signal_by_round),
            sum(grants),
            sum(1 for n in grants if n),
            signal_by_round[-1],
            len(pools),
            time.monotonic() - started,
        )
    groups = [group for members in pools if (group := _finalise(members[0].episode_id, members, cfg, report))]
    spent = cfg.resample_budget - budget
    stats = {
        "contexts": len(pools),
        "groups_with_signal": len(groups),
        "replies": spent,
        "budget": cfg.resample_budget,
        "rounds": len(signal_by_round),
        "groups_with_signal_by_round": signal_by_round,
        "replies_per_group_with_signal": round(spent / len(groups), 1) if groups else None,
        "rollouts": counters.as_dict(),
        "wall_s": round(time.monotonic() - started, 1),
    }
    return groups, stats


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
    """Adapts the policy's configured scorer (function, webhook or RULER) to score resampled attempts.

    Each attempt is scored as the whole conversation it made; a scorer failure leaves the whole batch unscored
    (counted), never stops the run. RULER (source `judge`) scores relative to the group, so it judges the
    original conversation along with the new ones and the original's score is discarded: it keeps its own reward.
    """

    def __init__(self, inner: Scorer, policy: str) -> None:
        self.inner = inner
        self.policy = policy

    async def score(
        self, conversations: list[list[dict[str, Any]]], original: list[dict[str, Any]]
    ) -> list[float | None]:
        transcripts = [
            EpisodeTranscript(episode_id=f"resample-{i}", messages=messages, policy=self.policy)
            for i, messages in enumerate(conversations)
        ]
        judged = list(transcripts)
        if self.inner.source == "judge":
            judged.insert(0, EpisodeTranscript(episode_id="original", messages=original, policy=self.policy))
        outcome = await self.inner.score(judged)
        if outcome.scores is None:
            logger.warning("scorer failed on resampled attempts: %s", outcome.error)
            return [None] * len(conversations)
        by_id = {s.episode_id: s.value for s in outcome.scores}
        return [by_id.get(t.episode_id) for t in transcripts]
