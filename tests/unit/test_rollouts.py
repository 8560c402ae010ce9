"""Whole-episode rollouts: where they start, how tool calls are answered (for real, replayed, or not at all), the
options each turn repeats, and how a rollout ends."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

import pytest

from trainer.control.rollouts import (
    RolloutCounters,
    RolloutTask,
    SampledTurn,
    ToolOutcome,
    carried_options,
    episode_start,
    hermes_message,
    recorded_results,
    reply_limit,
    request_options,
    roll_out,
)

USER = {"role": "user", "content": "What is the capital of Zorland?"}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


def call(arguments: str, call_id: str = "call_1", name: str = "lookup") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def asks(*calls: dict[str, Any]) -> SampledTurn:
    return SampledTurn({"role": "assistant", "content": None, "tool_calls": list(calls)}, "tool_calls")


def says(text: str, finish_reason: str = "stop") -> SampledTurn:
    return SampledTurn({"role": "assistant", "content": text}, finish_reason)


class Scripted:
    """Answers from a script: the first turn's replies in order, later turns from what the last tool said."""

    max_concurrency = 8

    def __init__(self, firsts: list[SampledTurn], later: dict[str, SampledTurn]) -> None:
        self.firsts = firsts
        self.later = later
        self.requests: list[tuple[int, Mapping[str, Any]]] = []

    async def sample(
        self, messages: list[dict[str, Any]], tools: list[Any] | None, n: int, options: Mapping[str, Any]
    ) -> list[SampledTurn]:
        self.requests.append((len(messages), options))
        if messages[-1]["role"] == "user":
            return self.firsts[:n]
        return [self.later[messages[-1]["content"]]]


class Tools:
    """`lookup` answers from a table (an unknown key is an error, as a tool reports one); others are unknown."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def can_call(self, name: str) -> bool:
        return name == "lookup"

    async def call(self, name: str, arguments: str) -> ToolOutcome:
        self.calls.append(arguments)
        key = json.loads(arguments).get("key")
        if key == "zorland":
            return ToolOutcome("capital: Quix")
        return ToolOutcome(f"error: no entry {key!r}", is_error=True)


def test_an_agent_rolls_out_with_real_tool_calls_and_each_turns_options() -> None:
    forced = {"tool_choice": {"type": "function", "function": {"name": "lookup"}}}
    sampler = Scripted(
        [asks(call('{"key": "zorland"}')), asks(call('{"key": "mars"}')), says("I do not know.")],
        {"capital: Quix": says("Quix."), "error: no entry 'mars'": says("Sorry.")},
    )
    tools = Tools()
    task = RolloutTask([USER], TOOLS, [forced, {"tool_choice": "auto"}])
    right, wrong, direct = asyncio.run(roll_out(task, 3, sampler, tools, max_turns=4))
    assert right.messages == [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [call('{"key": "zorland"}')]},
        {"role": "tool", "tool_call_id": "call_1", "content": "capital: Quix"},
        {"role": "assistant", "content": "Quix."},
    ]
    assert (right.ending, right.tool_calls, right.tool_errors, len(right.turns)) == ("answered", 1, 0, 2)
    # A failing tool is an answer too: the agent reads the error and goes on.
    assert (wrong.ending, wrong.tool_errors, wrong.messages[-1]["content"]) == ("answered", 1, "Sorry.")
    assert (direct.ending, direct.tool_calls, len(direct.turns)) == ("answered", 0, 1)
    # The first turn was drawn once for all three, forced; the follow-ups with the second call's options.
    assert sampler.requests == [(1, forced), (3, {"tool_choice": "auto"}), (3, {"tool_choice": "auto"})]
    counters = RolloutCounters()
    for rollout in (right, wrong, direct):
        counters.add(rollout)
    assert counters.as_dict() == {
        "rollouts": 3,
        "turns": 5,
        "tool_calls": 2,
        "tool_errors": 1,
        "replayed_results": 0,
        "endings": {"answered": 3},
    }


def test_a_recorded_result_is_replayed_for_the_identical_call_only() -> None:
    """Without a tool Kaizen can run, the captured episode's own result answers the same call (however its
    arguments are spelled); any other call cannot be answered, and the rollout is dropped."""
    captured = [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [call('{"key":"zorland", "n": 1}', "c9")]},
        {"role": "tool", "tool_call_id": "c9", "content": "capital: Quix"},
        {"role": "assistant", "content": "Quix."},
    ]
    recorded = recorded_results(captured)
    assert recorded == {("lookup", '{"key":"zorland","n":1}'): "capital: Quix"}
    sampler = Scripted(
        [asks(call('{"n": 1,  "key": "zorland"}')), asks(call('{"key": "mars"}'))],
        {"capital: Quix": says("Quix.")},
    )
    task = RolloutTask([USER], TOOLS, recorded=recorded)
    replayed, stuck = asyncio.run(roll_out(task, 2, sampler, None, max_turns=4))
    assert (replayed.ending, replayed.replayed, replayed.messages[-1]["content"]) == ("answered", 1, "Quix.")
    assert stuck.ending == "unanswerable"


def test_a_rollout_ends_at_the_turn_limit_or_when_its_reply_is_cut() -> None:
    looping = Scripted(
        [asks(call('{"key": "zorland"}'))], {"capital: Quix": asks(call('{"key": "zorland"}'))}
    )
    [rollout] = asyncio.run(roll_out(RolloutTask([USER], TOOLS), 1, looping, Tools(), max_turns=3))
    assert (rollout.ending, len(rollout.turns), rollout.tool_calls) == ("turn_limit", 3, 2)
    cut = Scripted([says("The capital of Zorland is", "length")], {})
    [rollout] = asyncio.run(roll_out(RolloutTask([USER], TOOLS), 1, cut, Tools(), max_turns=3))
    assert rollout.ending == "truncated"
    # Cut where the app itself would have cut it: the reply the app got, an ending like any answer.
    as_served = SampledTurn(
        {"role": "assistant", "content": "The capital of Zorland is"}, "length", app_limit=True
    )
    [rollout] = asyncio.run(
        roll_out(RolloutTask([USER], TOOLS), 1, Scripted([as_served], {}), Tools(), max_turns=3)
    )
    assert rollout.ending == "cut"


def test_a_rollout_repeats_the_apps_reply_limit_up_to_the_trainers_cap() -> None:
    """The app's `max_completion_tokens` (else `max_tokens`) is carried; a sampler uses it when it is within its
    own cap, and says so, so a reply cut there counts as the app's own."""
    request = {"tool_choice": "required", "max_tokens": 64, "max_completion_tokens": 48, "temperature": 0.3}
    options = carried_options(request)
    assert options == {"tool_choice": "required", "max_tokens": 48}
    assert request_options(options) == {"tool_choice": "required"}
    assert reply_limit(options, 96) == (48, True)
    assert reply_limit(options, 48) == (48, True)
    assert reply_limit(options, 32) == (32, False)  # the trainer's cap is lower: a cut is the trainer's
    assert reply_limit({}, 32) == (32, False)
    assert carried_options({"max_tokens": 0}) == {} and carried_options({"max_tokens": True}) == {}


@pytest.mark.parametrize(
    ("roles", "start"),
    [
        (["system", "user"], 2),  # one answer: its context
        (["system", "user", "assistant", "tool"], 2),  # an agent: before its first tool call
        (["user", "assistant", "user", "assistant", "tool", "tool"], 3),  # after the last thing a person said
        (["assistant", "tool"], 0),
    ],
)
def test_the_start_is_before_the_agents_part(roles: list[str], start: int) -> None:
    context = [{"role": role, "content": str(i)} for i, role in enumerate(roles)]
    assert episode_start(context) == context[:start]


def test_hermes_tool_calls_are_read_from_text() -> None:
    text = 'Let me look.\n<tool_call>\n{"name": "lookup", "arguments": {"key": "zorland"}}\n</tool_call>'
    message = hermes_message(text)
    assert message["content"] == "Let me look."
    [found] = message["tool_calls"]
    assert found["function"] == {"name": "lookup", "arguments": '{"key": "zorland"}'}
    assert hermes_message("<tool_call>not json</tool_call>") == {
        "role": "assistant",
        "content": "<tool_call>not json</tool_call>",
    }
