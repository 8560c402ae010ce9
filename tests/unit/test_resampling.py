"""Adaptive resampling where successes are rare: the plan (`allocate`, a pure function) and the rounds it drives."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest

from trainer.control.policy_config import TrainConfig
from trainer.control.rollouts import SampledTurn
from trainer.learner.dataset import DataReport, TrainingExample
from trainer.learner.grouping import Pool, allocate, resample_groups


def test_every_context_is_first_topped_up_to_the_group_size() -> None:
    pools = [Pool(1, False), Pool(3, True), Pool(8, False), Pool(9, True)]
    assert allocate(pools, 100, group_size=8, max_group_size=32) == [7, 5, 8, 0]


def test_later_rounds_go_only_to_groups_without_reward_variance_up_to_the_cap() -> None:
    pools = [Pool(8, True), Pool(8, False), Pool(28, False), Pool(32, False), Pool(16, True)]
    assert allocate(pools, 100, group_size=8, max_group_size=32) == [0, 8, 4, 0, 0]


def test_a_short_budget_goes_to_the_contexts_with_fewest_replies_first() -> None:
    # Spread over many contexts: the two still at their first reply are served before the one already at 16.
    pools = [Pool(16, False), Pool(1, False), Pool(1, False)]
    assert allocate(pools, 10, group_size=8, max_group_size=32) == [0, 7, 3]
    assert allocate(pools, 20, group_size=8, max_group_size=32) == [6, 7, 7]


def test_ties_keep_the_given_order_and_nothing_is_granted_without_budget() -> None:
    pools = [Pool(1, False)] * 3
    assert allocate(pools, 8, group_size=4, max_group_size=8) == [3, 3, 2]
    assert allocate(pools, 0, group_size=4, max_group_size=8) == [0, 0, 0]
    assert allocate([], 10, group_size=4, max_group_size=8) == []


def test_a_cap_below_the_group_size_means_no_extra_rounds() -> None:
    assert allocate([Pool(4, False)], 10, group_size=4, max_group_size=2) == [0]


class Scripted:
    """Replies per context from a script: the k-th reply drawn for a context is right if k is in its set."""

    max_concurrency = 64

    def __init__(self, right: dict[str, set[int]]) -> None:
        self.right = right
        self.drawn: Counter[str] = Counter()
        self.calls: list[tuple[str, int]] = []

    async def sample(
        self, messages: list[dict[str, Any]], tools: list[Any] | None, n: int, options: Any
    ) -> list[SampledTurn]:
        question = messages[-1]["content"]
        self.calls.append((question, n))
        out = []
        for _ in range(n):
            self.drawn[question] += 1
            text = "right" if self.drawn[question] in self.right[question] else "wrong"
            out.append(SampledTurn({"role": "assistant", "content": text}, "stop", [1], [5, 2], [-0.1, -0.1]))
        return out


class Checker:
    async def score(
        self, conversations: list[list[dict[str, Any]]], original: list[dict[str, Any]]
    ) -> list[float | None]:
        return [float(c[-1]["content"] == "right") for c in conversations]


def captured(i: int, question: str, reward: float) -> TrainingExample:
    return TrainingExample(
        episode_id=f"e{i}",
        context=[{"role": "user", "content": question}],
        tools=None,
        reply={"role": "assistant", "content": "right" if reward else "wrong"},
        reward=reward,
        prompt_token_ids=[1],
        completion_token_ids=[5, 2],
        completion_logprobs=[-0.1, -0.1],
    )


def test_flat_groups_are_resampled_until_a_rare_success_gives_them_signal() -> None:
    sampler = Scripted({"easy": {1, 3}, "hard": {13}, "hopeless": set()})
    cfg = TrainConfig(group_size=4, resample_max_group_size=16, resample_budget=100)
    report = DataReport()
    trajectories = [captured(0, "easy", 0.0), captured(1, "hard", 0.0), captured(2, "hopeless", 0.0)]
    groups, stats = asyncio.run(resample_groups(trajectories, cfg, sampler, Checker(), report))
    assert [(g.key, len(g.members), sum(g.rewards)) for g in groups] == [("e0", 4, 2.0), ("e1", 16, 1.0)]
    # Round 1 tops every context up to 4; then only the flat ones get 4 more a round, up to 16.
    assert stats["groups_with_signal_by_round"] == [1, 1, 1, 2]
    assert stats["replies"] == 3 * 3 + 3 * 2 * 4 == report.as_dict()["resampled_replies"]
    assert stats["contexts"] == 3 and stats["groups_with_signal"] == 2 and stats["rounds"] == 4
    assert sampler.drawn == {"easy": 3, "hard": 15, "hopeless": 15}


def test_the_budget_caps_the_replies_and_a_rare_captured_success_is_served_first() -> None:
    sampler = Scripted({"a": set(), "b": set(), "c": set()})
    cfg = TrainConfig(group_size=4, resample_max_group_size=16, resample_budget=3)
    # The window's mean reward is 1/3: the captured success of "b" is the surprise worth resampling first.
    trajectories = [captured(0, "a", 0.0), captured(1, "b", 1.0), captured(2, "c", 0.0)]
    groups, stats = asyncio.run(resample_groups(trajectories, cfg, sampler, Checker(), DataReport()))
    assert sampler.calls == [("b", 3)]
    assert [(g.key, g.rewards) for g in groups] == [("e1", [1.0, 0.0, 0.0, 0.0])]
    assert stats["replies"] == 3 and stats["budget"] == 3


def test_captured_attempts_at_one_context_share_a_group() -> None:
    sampler = Scripted({"q": set()})
    cfg = TrainConfig(group_size=4, resample_budget=100)
    report = DataReport()
    trajectories = [captured(0, "q", 0.0), captured(1, "q", 1.0), captured(2, "q", 0.0)]
    [group], stats = asyncio.run(resample_groups(trajectories, cfg, sampler, Checker(), report))
    assert [m.origin for m in group.members] == ["captured"] * 3 + ["resampled"]
    assert sampler.calls == [("q", 1)] and stats["replies"] == 1
    assert report.as_dict()["contexts_merged"] == 2


@pytest.mark.parametrize("budget", [0, 1])
def test_with_no_budget_only_captured_groups_with_signal_train(budget: int) -> None:
    sampler = Scripted({"q": set(), "r": set()})
    cfg = TrainConfig(group_size=4, resample_budget=budget)
    trajectories = [captured(0, "q", 0.0), captured(1, "q", 1.0), captured(2, "r", 0.0)]
    groups, stats = asyncio.run(resample_groups(trajectories, cfg, sampler, Checker(), DataReport()))
    assert [g.key for g in groups] == ["e0"] and stats["replies"] == budget


def test_an_agent_episode_is_resampled_whole_from_its_start() -> None:
    """The captured episode called a tool and answered; its group is rolled out from the question, each
    attempt calling the tool (for real, or replayed) and answering, and is scored as a whole conversation."""
    from tests.unit.test_rollouts import TOOLS, USER, Scripted, Tools, asks, call, says

    tool_call = {"role": "assistant", "content": None, "tool_calls": [call('{"key": "zorland"}', "c0")]}
    result = {"role": "tool", "tool_call_id": "c0", "content": "capital: Quix"}
    captured_agent = TrainingExample(
        episode_id="agent",
        context=[USER, tool_call, result],
        tools=TOOLS,
        reply={"role": "assistant", "content": "Quix."},
        reward=1.0,
        prompt_token_ids=None,
        completion_token_ids=[7, 2],
        completion_logprobs=None,
        options={"tool_choice": "auto"},
    )
    sampler = Scripted(
        [
            asks(call('{"key": "zorland"}')),
            asks(call('{"key": "mars"}')),
            asks(call('{"x": 1}', name="weather")),  # nobody can answer: dropped
            says("Quix is the", "length"),  # cut by the trainer's cap: dropped
            SampledTurn({"role": "assistant", "content": "Quix and"}, "length", app_limit=True),  # as the app
        ],
        {"capital: Quix": says("Quix."), "error: no entry 'mars'": says("Mars?")},
    )

    class WholeConversations:
        def __init__(self) -> None:
            self.seen: list[list[dict[str, Any]]] = []

        async def score(
            self, conversations: list[list[dict[str, Any]]], original: list[dict[str, Any]]
        ) -> list[float | None]:
            self.seen.extend(conversations)
            return [float(c[-1]["content"] == "Quix.") for c in conversations]

    scorer = WholeConversations()
    report = DataReport()
    cfg = TrainConfig(group_size=6, resample_max_group_size=6)
    [group], stats = asyncio.run(
        resample_groups([captured_agent], cfg, sampler, scorer, report, tools=Tools())
    )
    assert [m.origin for m in group.members] == ["captured", "resampled", "resampled", "resampled"]
    # The reply cut at the app's own limit is scored as the app saw it (a failure here), not left out.
    assert group.rewards == [1.0, 1.0, 0.0, 0.0]
    assert group.members[3].reply["content"] == "Quix and"
    first = group.members[1]
    # A rollout is a whole episode: its final turn answers the tool's result, its tool call is an earlier turn.
    assert first.context == [USER, first.earlier[0].reply, result | {"tool_call_id": "call_1"}]
    assert first.earlier[0].context == [USER] and first.earlier[0].options == {"tool_choice": "auto"}
    assert [len(c) for c in scorer.seen] == [4, 4, 2]  # question, call, result, answer; the cut first turn
    assert report.as_dict()["rollouts_unanswerable"] == 1 and report.as_dict()["rollouts_truncated"] == 1
    assert stats["rollouts"]["endings"] == {"answered": 2, "cut": 1, "truncated": 1, "unanswerable": 1}
    assert stats["rollouts"]["tool_calls"] == 2
