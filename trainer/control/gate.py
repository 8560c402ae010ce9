"""The evaluation gate: a candidate version is promoted only if it is not worse than the active one.

Both versions attempt the same held-out tasks through the serving engine (``policy@N`` and ``policy@M`` on
the gateway's OpenAI-compatible URL, with ``X-Kaizen-No-Log`` so nothing is captured): a task starts where its
episode's agent part starts (`trainer.control.rollouts`), so an agent's attempt is a whole rollout with its tool
calls answered (by the policy's tools that may run outside traffic, else by the episode's recorded results), and a
one-answer task's attempt is one reply. The policy's scorer (reward function, webhook or RULER) scores each
task's attempts of both versions as one group, and the
collapse signals of the candidate's replies must stay within `CollapseBounds` of the active version's. Movement
bounds (length, entropy) are waived for a candidate whose healthy replies earned more than the active version's
on the same contexts (`trainer.control.collapse.backed_by_reward`): terse because terse is right is not collapse.
With `gate.seed` set, both versions answer each context with the same seed (`context_seed`): a paired comparison on
the same random draws, which a rerun on the same versions and contexts repeats.

Held-out contexts come from rewarded episodes the run did not train on: episodes outside the run's data
window, and episodes whose group hashes into the held-out fraction (`is_held_out`), which training should
leave out so that they stay unseen.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx

from storage.database import Database
from storage.episodes import EpisodeTranscript
from storage.jobs import RunInfo
from storage.training import episode_calls, rewarded_episodes
from trainer.control.collapse import (
    CollapseBounds,
    CollapseSignals,
    backed_by_reward,
    check,
    measure,
    movement_problems,
)
from trainer.control.gateway_requests import ENGINE_RESTART_WAIT_S, gateway_headers, post_completion
from trainer.control.policy_config import GateConfig
from trainer.control.rollouts import (
    RolloutTask,
    SampledTurn,
    ToolCaller,
    carried_options,
    episode_start,
    recorded_results,
    reply_limit,
    request_options,
    roll_out,
)
from trainer.control.scoring import GroupScore, Scorer

logger = logging.getLogger(__name__)


def is_held_out(group: str, fraction: float) -> bool:
    """Stable across processes and runs: the group's hash decides, so a held-out task stays unseen."""
    digest = hashlib.sha256(group.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


@dataclass(frozen=True)
class Context:
    """A held-out task: its group, where attempts start, the tools offered, and how its episode went (each
    turn's request options, the tool results it recorded)."""

    group: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    options: list[dict[str, Any]] = field(default_factory=list)
    recorded: dict[tuple[str, str], str] = field(default_factory=dict)

    def task(self) -> RolloutTask:
        return RolloutTask(self.messages, self.tools, self.options, self.recorded)


@dataclass
class GateResult:
    """The decision and the numbers behind it (stored as ``training_runs.metrics["gate"]``)."""

    decision: str  # promote | reject
    candidate_version: int
    active_version: int
    reasons: list[str] = field(default_factory=list)
    groups: int = 0
    candidate_reward: float | None = None
    active_reward: float | None = None
    tolerance: float = 0.0
    candidate_signals: dict[str, Any] | None = None
    active_signals: dict[str, Any] | None = None
    collapse_problems: list[str] = field(default_factory=list)
    #: Movement bounds the candidate crossed with the reward's backing (not reasons to reject).
    waived: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def passed(self) -> bool:
        return self.decision == "promote"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _window(run: RunInfo) -> tuple[datetime | None, datetime | None]:
    def parse(value: Any) -> datetime | None:
        if not isinstance(value, str):
            return None
        parsed = datetime.fromisoformat(value)
        return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)

    return parse(run.config.get("data_since")), parse(run.config.get("data_until"))


async def held_out_contexts(
    database: Database, policy: str, run: RunInfo, config: GateConfig
) -> list[Context]:
    """Contexts of recent rewarded episodes the run did not train on, one per group, newest first."""
    since, until = _window(run)
    async with database.session() as session:
        episodes = await rewarded_episodes(session, policy, since=None, until=datetime.now(UTC))
        picked = []
        seen: set[str] = set()
        for episode in reversed(episodes):
            group = episode.group_key or episode.id
            created = (
                episode.created_at if episode.created_at.tzinfo else episode.created_at.replace(tzinfo=UTC)
            )
            trained_on = (since is None or created > since) and (until is None or created <= until)
            if group in seen or (trained_on and not is_held_out(group, config.holdout_fraction)):
                continue
            seen.add(group)
            picked.append((group, episode.id))
            if len(picked) >= config.max_groups * 2:  # some may lack a usable context
                break
        calls = await episode_calls(session, [episode_id for _, episode_id in picked])
    contexts = []
    for group, episode_id in picked:
        ok = [c for c in calls.get(episode_id, []) if c.status == "ok"]
        if not ok:
            continue
        request = ok[-1].request
        messages = list(request.get("messages") or [])
        start = episode_start(messages)
        if not start:
            continue
        choices = (ok[-1].response or {}).get("choices") or []
        reply = [_reply_message(choices[0])] if choices else []
        # The calls of the agent's part, in order: what each of its turns asked for.
        agent = [c for c in ok if len(c.request.get("messages") or []) >= len(start)]
        options = [carried_options(c.request) for c in agent]
        contexts.append(
            Context(group, start, request.get("tools"), options, recorded_results([*messages, *reply]))
        )
        if len(contexts) >= config.max_groups:
            break
    return contexts


def _reply_message(choice: dict[str, Any]) -> dict[str, Any]:
    message = choice.get("message") or {}
    reply: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        reply["tool_calls"] = message["tool_calls"]
    return reply


def _attempt_text(attempt: list[dict[str, Any]]) -> str:
    """What the collapse signals see of an attempt: each turn's text, or its tool calls for a turn that only
    calls tools (an agent that stops calling its tools, or calls them with garbage, shows here)."""
    parts = []
    for message in attempt:
        if message.get("role") != "assistant":
            continue
        if message.get("content"):
            parts.append(str(message["content"]))
        elif message.get("tool_calls"):
            parts.append(json.dumps(message["tool_calls"]))
    return "\n".join(parts)


class VersionSampler:
    """Attempts held-out tasks with one version through an OpenAI-compatible URL (the gateway's own, by default):
    `config.samples` rollouts each, their tool calls answered by `tools` or the task's recorded results."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        config: GateConfig,
        wait_for_version_s: float = ENGINE_RESTART_WAIT_S,
        *,
        tools: ToolCaller | None = None,
        max_turns: int = 8,
    ) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.headers = gateway_headers(api_key)
        self.config = config
        self.wait_for_version_s = wait_for_version_s
        self.tools = tools
        self.max_turns = max_turns

    async def sample(
        self, client: httpx.AsyncClient, model: str, context: Context, seed: int | None = None
    ) -> list[list[dict[str, Any]]]:
        """Each attempt's own part of the conversation (its turns and the tool results between them); an attempt
        that reached a tool call nobody could answer is left out."""
        turns = _VersionTurns(self, client, model, seed)
        # vLLM refuses n > 1 for greedy sampling, whose attempts would be identical anyway.
        n = self.config.samples if self.config.temperature > 0 else 1
        rollouts = await roll_out(context.task(), n, turns, self.tools, max_turns=self.max_turns)
        start = len(context.messages)
        return [r.messages[start:] for r in rollouts if r.ending != "unanswerable"]


@dataclass
class _VersionTurns:
    """One version's turns for `roll_out`: the first with the gate's seed (both versions draw alike)."""

    sampler: VersionSampler
    client: httpx.AsyncClient
    model: str
    seed: int | None

    async def sample(
        self, messages: list[dict[str, Any]], tools: list[Any] | None, n: int, options: Mapping[str, Any]
    ) -> list[SampledTurn]:
        config = self.sampler.config
        limit, app_limit = reply_limit(options, config.max_tokens)
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "n": n,
            "max_tokens": limit,
            "temperature": config.temperature,
        }
        if self.seed is not None:
            body["seed"] = self.seed
            self.seed = None  # a later turn is its own draw
        if tools:
            body["tools"] = tools
            body.update(request_options(options))
        answer = await post_completion(
            self.client, self.sampler.url, body, self.sampler.headers, self.sampler.wait_for_version_s
        )
        return [
            SampledTurn(_reply_message(c), c.get("finish_reason"), app_limit=app_limit)
            for c in answer["choices"]
        ]


@dataclass
class _Attempts:
    """Both versions' attempts at one held-out context: the transcripts, whose each is, what each said, and
    their scores."""

    trajectories: list[EpisodeTranscript]
    owners: list[int]
    texts: list[str]
    scored: GroupScore


def context_seed(seed: int | None, context: Context) -> int | None:
    """The seed both versions sample `context` with: drawn from `gate.seed` and what the context asks, so it
    does not depend on which other contexts the gate evaluates or in what order; None when `gate.seed` is unset.

    A 31-bit number: with the j-th of n replies seeded seed + j (vLLM), it stays within any engine's seeds."""
    if seed is None:
        return None
    asked = json.dumps([seed, context.messages, context.tools], sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(asked.encode()).digest()[:4], "big") >> 1


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def collapse_problems(
    candidate: CollapseSignals, active: CollapseSignals, bounds: CollapseBounds
) -> list[str]:
    """Bounds the candidate violates relative to the active version; a floor the active one misses too is
    the base model's habit on these contexts, not the candidate's fault."""
    inherited = {problem.split()[0] for problem in check(active, bounds)}
    return [
        p
        for p in check(candidate, bounds, baseline=active)
        if "baseline" in p or p.split()[0] not in inherited
    ]


async def evaluate(
    database: Database,
    policy: str,
    run: RunInfo,
    candidate: int,
    active: int,
    *,
    scorer: Scorer,
    sampler: VersionSampler,
    config: GateConfig,
) -> GateResult:
    """Sample, score and compare both versions on held-out contexts; never promotes by itself."""
    started = time.perf_counter()
    result = GateResult("reject", candidate, active, tolerance=config.tolerance)
    contexts = await held_out_contexts(database, policy, run, config)
    result.groups = len(contexts)
    if not contexts:
        result.reasons.append("no held-out rewarded episodes to evaluate on")
        result.wall_s = time.perf_counter() - started
        return result
    rewards: dict[int, list[float]] = {candidate: [], active: []}
    texts: dict[int, list[str]] = {candidate: [], active: []}
    asked: dict[int, list[int]] = {candidate: [], active: []}  # the context each text answers
    limit = asyncio.Semaphore(config.concurrency)
    timeout = httpx.Timeout(config.request_timeout_s, connect=10.0)

    async def attempt(client: httpx.AsyncClient, index: int, context: Context) -> _Attempts:
        """Both versions' attempts at one context, scored together (RULER compares them in one group)."""
        async with limit:
            seed = context_seed(config.seed, context)
            replies = await asyncio.gather(
                sampler.sample(client, f"{policy}@{candidate}", context, seed),
                sampler.sample(client, f"{policy}@{active}", context, seed),
            )
            trajectories: list[EpisodeTranscript] = []
            owners: list[int] = []
            for version, versions_attempts in zip((candidate, active), replies, strict=True):
                for j, messages in enumerate(versions_attempts):
                    trajectories.append(
                        EpisodeTranscript(
                            episode_id=f"gate-{run.id}-{index}-{version}-{j}",
                            messages=[*context.messages, *messages],
                            policy=policy,
                            group_key=context.group,
                        )
                    )
                    owners.append(version)
            texts = [_attempt_text(t.messages[len(context.messages) :]) for t in trajectories]
            return _Attempts(trajectories, owners, texts, await scorer.score(trajectories))

    # Contexts are attempted `gate.concurrency` at a time: the engine batches their requests, and the results
    # are taken in the contexts' order, so the decision does not depend on which finished first.
    # One failure (the engine gone) cancels the other contexts' attempts and is raised as itself.
    try:
        async with httpx.AsyncClient(timeout=timeout) as client, asyncio.TaskGroup() as group:
            pending = [group.create_task(attempt(client, i, c)) for i, c in enumerate(contexts)]
    except ExceptionGroup as failures:
        raise failures.exceptions[0] from None
    for index, (context, task) in enumerate(zip(contexts, pending, strict=True)):
        attempts = task.result()
        scored = attempts.scored
        if scored.scores is None:
            result.reasons.append(f"scoring failed on group {context.group}: {scored.error}")
            result.wall_s = time.perf_counter() - started
            return result
        by_id = {s.episode_id: s.value for s in scored.scores}
        for trajectory, version, text in zip(
            attempts.trajectories, attempts.owners, attempts.texts, strict=True
        ):
            texts[version].append(text)
            asked[version].append(index)
            if trajectory.episode_id in by_id:
                rewards[version].append(by_id[trajectory.episode_id])
    if not rewards[candidate] or not rewards[active]:
        result.reasons.append("the scorer returned no scores")
        result.wall_s = time.perf_counter() - started
        return result
    result.candidate_reward, result.active_reward = _mean(rewards[candidate]), _mean(rewards[active])
    candidate_signals = measure(texts[candidate], contexts=asked[candidate], rewards=rewards[candidate])
    active_signals = measure(texts[active], contexts=asked[active], rewards=rewards[active])
    result.candidate_signals, result.active_signals = asdict(candidate_signals), asdict(active_signals)
    bounds = config.bounds()
    result.collapse_problems = collapse_problems(candidate_signals, active_signals, bounds)
    if backed_by_reward(candidate_signals, bounds, active_signals):
        result.waived = movement_problems(candidate_signals, bounds, active_signals)
    if result.candidate_reward < result.active_reward - config.tolerance:
        result.reasons.append(
            f"mean reward {result.candidate_reward:.4f} < active {result.active_reward:.4f} "
            f"- tolerance {config.tolerance}"
        )
    result.reasons.extend(f"collapse: {p}" for p in result.collapse_problems)
    if not result.reasons:
        result.decision = "promote"
    result.wall_s = time.perf_counter() - started
    logger.info(
        "gate %s@%d vs @%d on %d groups: %s (reward %.4f vs %.4f)%s",
        policy,
        candidate,
        active,
        result.groups,
        result.decision,
        result.candidate_reward,
        result.active_reward,
        "; " + "; ".join(result.reasons) if result.reasons else "",
    )
    return result
