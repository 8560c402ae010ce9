"""Whole-episode rollouts: an agent episode run again from its start, with its tools called for real.

An episode's *start* is its conversation up to the agent's first turn after the last thing a person (or the app's
own system or developer prompt) said: everything after it is the agent's, assistant turns and the tool results
they asked for. That is what a rollout re-runs: the policy answers the start; while it asks for tools, each call
is answered (by a tool Kaizen can run, or by the result the captured episode recorded for the identical call) and
the policy answers again, up to a turn limit. A single-turn episode's rollout is one reply, as resampling was
before.

The loop is shared by the learner's resampling (through the engine, with token ids), the evaluation gate (both
versions through the gateway) and MCP•RL bootstrapping; it needs no torch. A rollout that reaches a call nobody
can answer is not a trajectory of the task and is dropped (counted). A reply cut by a token limit ends its
rollout: where the limit was the app's own (`max_tokens` of the captured call, no more than the trainer's cap) the
app would have been sent that cut reply, so the rollout ends `cut` and is scored like any other; where the
trainer's cap cut it, the rollout ends `truncated`, for its user to leave out of groups.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

logger = logging.getLogger(__name__)

#: Request options of a captured call that a rollout's call at the same turn carries over.
CARRIED_OPTIONS = ("tool_choice", "parallel_tool_calls", "response_format")
#: The carried option naming the app's own reply limit (from `max_completion_tokens`, else `max_tokens`).
APP_LIMIT = "max_tokens"
#: Message roles that belong to the agent's part of an episode.
AGENT_ROLES = frozenset({"assistant", "tool", "function"})

Ending = Literal["answered", "cut", "truncated", "turn_limit", "unanswerable"]
#: Endings that are trajectories of the task as the app would have run it: they are scored and grouped.
USABLE_ENDINGS: frozenset[Ending] = frozenset({"answered", "cut", "turn_limit"})


def episode_start(context: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages before the agent's part of the episode whose final turn answers `context`."""
    end = len(context)
    while end > 0 and context[end - 1].get("role") in AGENT_ROLES:
        end -= 1
    return [dict(m) for m in context[:end]]


def carried_options(request: Mapping[str, Any]) -> dict[str, Any]:
    """What of a captured call's request a rollout's call at the same turn repeats: a forced first tool call is
    resampled forced, not as `auto`; and the app's reply limit, so a reply it would have cut is cut alike.

    `request` is the call as the gateway stores it: messages, tools and `tool_choice` at the top, every other
    body field under `params` (a flat body is read alike)."""
    params = request.get("params")
    fields = {**(params if isinstance(params, Mapping) else {}), **request}
    options = {name: fields[name] for name in CARRIED_OPTIONS if fields.get(name) is not None}
    limit = fields.get("max_completion_tokens") or fields.get("max_tokens")
    if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
        options[APP_LIMIT] = limit
    return options


def request_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The carried options a sampler sends as they are (the reply limit goes through `reply_limit`)."""
    return {name: value for name, value in options.items() if name != APP_LIMIT}


def reply_limit(options: Mapping[str, Any], cap: int) -> tuple[int, bool]:
    """The token limit of a rollout's turn, and whether it is the app's own: the app's `max_tokens` when it is
    no more than the trainer's `cap` (a reply cut there is the reply the app would have been sent), else `cap`."""
    limit = options.get(APP_LIMIT)
    if isinstance(limit, int) and 0 < limit <= cap:
        return limit, True
    return cap, False


def canonical_arguments(arguments: Any) -> str:
    """A tool call's arguments in one spelling, so the same call made twice is recognised."""
    value: Any = arguments
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            return arguments.strip()
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def tool_call_key(call: Mapping[str, Any]) -> tuple[str, str]:
    function = call.get("function") or {}
    return str(function.get("name", "")), canonical_arguments(function.get("arguments", ""))


def recorded_results(messages: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str], str]:
    """The results a captured episode got for its tool calls, by (tool, arguments): what a rollout may replay
    for an identical call when it cannot call the tool itself."""
    by_id: dict[str, tuple[str, str]] = {}
    results: dict[tuple[str, str], str] = {}
    for message in messages:
        if message.get("role") == "assistant":
            for call in message.get("tool_calls") or []:
                if isinstance(call, Mapping) and call.get("id"):
                    by_id[str(call["id"])] = tool_call_key(call)
        elif message.get("role") == "tool" and message.get("tool_call_id") in by_id:
            content = message.get("content")
            text = content if isinstance(content, str) else json.dumps(content, default=str)
            results.setdefault(by_id[str(message["tool_call_id"])], text)
    return results


_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def hermes_message(text: str) -> dict[str, Any]:
    """An assistant message from text with Hermes-style `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
    blocks, as vLLM's `hermes` parser reads them; a block that is not such JSON stays text."""
    calls: list[dict[str, Any]] = []
    for match in _HERMES_CALL.finditer(text):
        try:
            parsed = json.loads(match.group(1))
        except ValueError:
            continue
        if isinstance(parsed, dict) and isinstance(parsed.get("name"), str):
            arguments = parsed.get("arguments", {})
            calls.append(
                {
                    "id": f"call_{len(calls)}",
                    "type": "function",
                    "function": {
                        "name": parsed["name"],
                        "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                    },
                }
            )
    if not calls:
        return {"role": "assistant", "content": text}
    rest = _HERMES_CALL.sub("", text).strip()
    return {"role": "assistant", "content": rest or None, "tool_calls": calls}


@dataclass(frozen=True)
class SampledTurn:
    """One assistant turn a sampler drew, with the engine's exact tokens where it returns them."""

    message: dict[str, Any]
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    #: The token limit it ran under was the app's own: cut there, it is the reply the app would have been sent.
    app_limit: bool = False

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return list(self.message.get("tool_calls") or [])

    @property
    def text(self) -> str:
        content = self.message.get("content")
        return content if isinstance(content, str) else ""


class TurnSampler(Protocol):
    """Draws `n` assistant turns answering `messages` (the learner's engine sampler, the gate's versions)."""

    async def sample(
        self,
        messages: list[dict[str, Any]],
        tools: list[Any] | None,
        n: int,
        options: Mapping[str, Any],
    ) -> list[SampledTurn]: ...


@dataclass(frozen=True)
class ToolOutcome:
    """A tool's answer as the tool message's content; errors are answers too (the agent reads them)."""

    content: str
    is_error: bool = False


class ToolCaller(Protocol):
    """Tools a rollout may call for real (`trainer.control.tools.ToolBox`)."""

    def can_call(self, name: str) -> bool: ...

    async def call(self, name: str, arguments: str) -> ToolOutcome: ...


@dataclass
class Rollout:
    """One re-run of an episode: its turns (each with the context it answered) and how it ended."""

    start: list[dict[str, Any]]
    turns: list[tuple[list[dict[str, Any]], SampledTurn]] = field(default_factory=list)
    ending: Ending = "answered"
    tool_calls: int = 0
    tool_errors: int = 0
    replayed: int = 0

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The whole conversation: the start, then every turn and the tool results between them."""
        if not self.turns:
            return list(self.start)
        context, last = self.turns[-1]
        return [*context, last.message]


@dataclass
class RolloutCounters:
    """What rollouts cost and how they ended, for the run's report."""

    rollouts: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    replayed: int = 0
    endings: dict[str, int] = field(default_factory=dict)

    def add(self, rollout: Rollout) -> None:
        self.rollouts += 1
        self.turns += len(rollout.turns)
        self.tool_calls += rollout.tool_calls
        self.tool_errors += rollout.tool_errors
        self.replayed += rollout.replayed
        self.endings[rollout.ending] = self.endings.get(rollout.ending, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "rollouts": self.rollouts,
            "turns": self.turns,
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
            "replayed_results": self.replayed,
            "endings": dict(sorted(self.endings.items())),
        }


@dataclass(frozen=True)
class RolloutTask:
    """Where rollouts start and what they may use: the start, the tools offered, the captured calls' options
    per turn (the last one's for turns past them), and the captured episode's recorded tool results."""

    start: list[dict[str, Any]]
    tools: list[Any] | None
    options: Sequence[Mapping[str, Any]] = ()
    recorded: Mapping[tuple[str, str], str] = field(default_factory=dict)

    def options_at(self, turn: int) -> Mapping[str, Any]:
        if not self.options:
            return {}
        return self.options[min(turn, len(self.options) - 1)]


async def roll_out(
    task: RolloutTask,
    n: int,
    sampler: TurnSampler,
    tools: ToolCaller | None,
    *,
    max_turns: int,
    on_turn: Callable[[], None] | None = None,
) -> list[Rollout]:
    """`n` rollouts of `task`: the first turns are drawn together (an engine batches them), each rollout then
    goes on by itself while it calls tools, at most `max_turns` assistant turns in all."""
    firsts = await sampler.sample(task.start, task.tools, n, task.options_at(0))
    rollouts = [Rollout(list(task.start)) for _ in firsts]

    async def go_on(rollout: Rollout, turn: SampledTurn) -> Rollout:
        context = list(task.start)
        while True:
            rollout.turns.append((context, turn))
            if on_turn is not None:
                on_turn()
            if turn.finish_reason == "length":
                # Cut at the app's own limit, the app got this reply and ended its episode on it.
                rollout.ending = "cut" if turn.app_limit else "truncated"
                return rollout
            calls = turn.tool_calls
            if not calls:
                rollout.ending = "answered"
                return rollout
            if len(rollout.turns) >= max_turns:
                rollout.ending = "turn_limit"
                return rollout
            results = []
            for call in calls:
                outcome = await _answer(call, task, tools, rollout)
                if outcome is None:
                    rollout.ending = "unanswerable"
                    return rollout
                results.append(_tool_message(call, outcome))
            context = [*context, turn.message, *results]
            [turn] = await sampler.sample(context, task.tools, 1, task.options_at(len(rollout.turns)))

    return list(await asyncio.gather(*(go_on(r, t) for r, t in zip(rollouts, firsts, strict=True))))


async def _answer(
    call: Mapping[str, Any], task: RolloutTask, tools: ToolCaller | None, rollout: Rollout
) -> ToolOutcome | None:
    name, arguments = tool_call_key(call)
    raw = (call.get("function") or {}).get("arguments", "")
    if tools is not None and tools.can_call(name):
        outcome = await tools.call(name, raw if isinstance(raw, str) else json.dumps(raw))
        rollout.tool_calls += 1
        rollout.tool_errors += outcome.is_error
        return outcome
    recorded = task.recorded.get((name, arguments))
    if recorded is None:
        return None
    rollout.replayed += 1
    return ToolOutcome(recorded)


def _tool_message(call: Mapping[str, Any], outcome: ToolOutcome) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": str(call.get("id", "")), "content": outcome.content}
