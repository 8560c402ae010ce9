"""Selection, grouping and tokenisation of trajectories: filters, skips and drops are counted, tokens are exact."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from storage.training import CallRow, EpisodeRow
from trainer.control.policy_config import InvalidPolicyConfig, TrainConfig, load_policy_config
from trainer.control.rollouts import SampledTurn
from trainer.learner.dataset import DataReport, TrainingExample, Turn, build_example, select_episodes
from trainer.learner.grouping import group_by_column, resample_groups
from trainer.learner.tokens import tokenize

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def episode(i: int, reward: float = 1.0, **kw: Any) -> EpisodeRow:
    base: dict[str, Any] = {
        "id": f"e{i}",
        "group_key": None,
        "meta": {},
        "tags": [],
        "reward": reward,
        "reward_count": 1,
        "created_at": T0 + timedelta(minutes=i),
    }
    return EpisodeRow(**{**base, **kw})


def trajectory(i: int, reward: float, **kw: Any) -> TrainingExample:
    base: dict[str, Any] = {
        "episode_id": f"e{i}",
        "context": [{"role": "user", "content": "q"}],
        "tools": None,
        "reply": {"role": "assistant", "content": "a"},
        "reward": reward,
        "prompt_token_ids": [1, 2, 3],
        "completion_token_ids": [7, 8, 9],
        "completion_logprobs": [-0.1, -0.2, -0.3],
    }
    return TrainingExample(**{**base, **kw})


def test_select_filters_and_caps_newest() -> None:
    episodes = [
        episode(0, tags=["a"]),
        episode(1, tags=["a", "b"], meta={"env": "prod"}),
        episode(2, tags=["a"], meta={"env": "prod"}, reward_count=0),
        episode(3, tags=["a"], meta={"env": "prod"}),
        episode(4, tags=["a"], meta={"env": "prod"}),
        episode(5, tags=[], meta={"env": "prod"}),
    ]
    cfg = TrainConfig(tags=["a"], metadata={"env": "prod"}, min_rewards=1, max_episodes=2)
    report = DataReport()
    kept = select_episodes(episodes, cfg, report)
    assert [e.id for e in kept] == ["e3", "e4"]
    assert report.as_dict() == {
        "capped": 1,
        "episodes_rewarded": 6,
        "filtered_metadata": 1,
        "filtered_min_rewards": 1,
        "filtered_tags": 1,
    }


def call(position: int, *, status: str = "ok", ids: list[int] | None = None, **kw: Any) -> CallRow:
    """The call at `position` of a chat loop: each turn's messages extend the last's with its reply and a user
    turn (`turn 0`, `ok`, `turn 1`, ...)."""
    messages: list[dict[str, Any]] = []
    for turn in range(position):
        messages += [{"role": "user", "content": f"turn {turn}"}, {"role": "assistant", "content": "ok"}]
    base: dict[str, Any] = {
        "id": f"c{position}",
        "episode_id": "e0",
        "position": position,
        "status": status,
        "request": {"messages": [*messages, {"role": "user", "content": f"turn {position}"}]},
        "response": {"choices": [{"message": {"role": "assistant", "content": "ok", "tool_calls": None}}]},
        "prompt_token_ids": [1, 2],
        "completion_token_ids": [ids or [5, 6]],
        "completion_logprobs": [[-1.0, -2.0]],
        "context_hash": "h",
        "group_key": None,
        "adapter_version": 1,
    }
    return CallRow(**{**base, **kw})


def test_trajectory_is_last_call_plus_reply_and_bad_episodes_are_counted() -> None:
    report = DataReport()
    t = build_example(episode(0), [call(0), call(1, ids=[8, 9])], report)
    assert t is not None
    assert t.context[-1] == {"role": "user", "content": "turn 1"} and len(t.context) == 3
    assert t.reply == {"role": "assistant", "content": "ok"}
    assert t.completion_token_ids == [8, 9] and t.completion_logprobs == [-1.0, -2.0]
    first = [{"role": "user", "content": "turn 0"}]
    assert t.earlier == [Turn(first, {"role": "assistant", "content": "ok"}, [1, 2], [5, 6], [-1.0, -2.0])]
    assert build_example(episode(1), [call(0, status="error")], report) is None
    assert build_example(episode(2), [], report) is None
    # logprobs that do not align with the ids are treated as unknown
    t = build_example(episode(3), [call(0, completion_logprobs=[[-1.0]])], report)
    assert t is not None and t.completion_logprobs is None
    assert report.as_dict() == {"dropped_no_calls": 1, "dropped_no_reply": 1}


def test_key_grouping_skips_flat_and_small_groups() -> None:
    ts = [
        trajectory(0, 1.0, group_key="g1"),
        trajectory(1, 0.0, group_key="g1"),
        trajectory(2, 1.0, group_key="g2"),
        trajectory(3, 1.0, group_key="g2"),
        trajectory(4, 0.5, group_key="g3"),
        trajectory(5, 0.5, group_key=None),
    ]
    report = DataReport()
    groups = group_by_column(ts, TrainConfig(grouping="key"), report)
    assert [(g.key, g.advantages) for g in groups] == [("g1", [0.5, -0.5])]
    assert report.as_dict() == {
        "dropped_no_group_key": 1,
        "groups_no_variance": 1,
        "groups_too_small": 1,
        "trajectories_in_flat_groups": 2,
        "trajectories_in_small_groups": 1,
    }


def test_prompt_grouping_uses_context_hash() -> None:
    ts = [
        trajectory(0, 1.0, context_hash="x"),
        trajectory(1, 0.0, context_hash="x"),
        trajectory(2, 0.0, context_hash="y"),
    ]
    groups = group_by_column(ts, TrainConfig(grouping="prompt"), DataReport())
    assert [[m.episode_id for m in g.members] for g in groups] == [["e0", "e1"]]


def turn(text: str, ids: list[int], logprobs: list[float] | None, prompt: list[int]) -> SampledTurn:
    return SampledTurn({"role": "assistant", "content": text}, "stop", prompt, ids, logprobs)


class FixedSampler:
    max_concurrency = 64

    async def sample(
        self, messages: list[dict[str, Any]], tools: list[Any] | None, n: int, options: Any
    ) -> list[SampledTurn]:
        return [turn(f"reply {i}", [10 + i, 2], [-0.5, -0.1], [1, 2]) for i in range(n)]


def last_text(conversation: list[dict[str, Any]]) -> str:
    return str(conversation[-1]["content"])


class LengthScorer:
    async def score(
        self, conversations: list[list[dict[str, Any]]], original: list[dict[str, Any]]
    ) -> list[float | None]:
        texts = [last_text(c) for c in conversations]
        return [None if r.endswith("2") else float(r.endswith("1")) for r in texts]


def test_resample_keeps_original_reward_and_counts_unscored() -> None:
    import asyncio

    report = DataReport()
    cfg = TrainConfig(grouping="resample", group_size=4)
    [group], _ = asyncio.run(
        resample_groups([trajectory(0, 0.5)], cfg, FixedSampler(), LengthScorer(), report)
    )
    assert [m.origin for m in group.members] == ["captured", "resampled", "resampled"]
    assert group.rewards == [0.5, 0.0, 1.0]
    assert (
        group.members[2].completion_token_ids == [11, 2]
        and group.members[2].context == group.members[0].context
    )
    assert report.as_dict() == {"resampled_replies": 3, "resampled_unscored": 1}


class SlowSampler:
    """Answers after a pause that shrinks with the context's index, recording how many calls overlap."""

    def __init__(self, max_concurrency: int, fail_on: str | None = None) -> None:
        self.max_concurrency = max_concurrency
        self.fail_on = fail_on
        self.in_flight = 0
        self.peak = 0

    async def sample(
        self, messages: list[dict[str, Any]], tools: list[Any] | None, n: int, options: Any
    ) -> list[SampledTurn]:
        import asyncio

        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            content = messages[-1]["content"]
            if content == self.fail_on:
                raise RuntimeError(f"engine gone while sampling {content}")
            await asyncio.sleep(0.05 / (1 + len(content)))
            return [turn(f"{content} {i}", [10 + i, 2], None, [1]) for i in range(n)]
        finally:
            self.in_flight -= 1


class IndexScorer:
    async def score(
        self, conversations: list[list[dict[str, Any]]], original: list[dict[str, Any]]
    ) -> list[float | None]:
        return [float(last_text(c).split()[-1]) for c in conversations]


def _contexts(count: int) -> list[Any]:
    from dataclasses import replace

    return [
        replace(trajectory(i, 0.5), episode_id=f"e{i}", context=[{"role": "user", "content": "q" * (i + 1)}])
        for i in range(count)
    ]


@pytest.mark.parametrize(("sampler_limit", "expected_peak"), [(64, 3), (1, 1)])
def test_resampling_runs_concurrently_up_to_the_limits_and_keeps_the_order(
    sampler_limit: int, expected_peak: int
) -> None:
    import asyncio

    sampler = SlowSampler(sampler_limit)
    cfg = TrainConfig(grouping="resample", group_size=3, resample_concurrency=3)
    groups, _ = asyncio.run(resample_groups(_contexts(10), cfg, sampler, IndexScorer(), DataReport()))
    assert sampler.peak == expected_peak
    # later contexts answer sooner, yet the groups keep the trajectories' order
    assert [g.members[0].episode_id for g in groups] == [f"e{i}" for i in range(10)]


def test_a_failed_resample_raises_its_own_error() -> None:
    import asyncio

    sampler = SlowSampler(64, fail_on="qqq")
    cfg = TrainConfig(grouping="resample", group_size=3, resample_concurrency=4)
    with pytest.raises(RuntimeError, match="engine gone while sampling qqq"):
        asyncio.run(resample_groups(_contexts(10), cfg, sampler, IndexScorer(), DataReport()))


class Template:
    """A stand-in chat template: each message renders as [100, len(content)], a generation prompt as [101]."""

    eos_token_id = 2

    def apply_chat_template(
        self, messages: list[dict[str, Any]], *, generation: bool = False, **kw: Any
    ) -> list[int]:
        ids = [t for m in messages for t in (100, len(m.get("content") or ""))]
        return [*ids, 101] if kw.get("add_generation_prompt") else [*ids, 102, 2, 13]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def test_captured_ids_carry_loss_with_behaviour_logprobs() -> None:
    report = DataReport()
    [sample] = tokenize(trajectory(0, 1.0), 0.5, Template(), TrainConfig(), report)
    assert sample.input_ids == [1, 2, 3, 7, 8, 9]
    assert sample.loss_mask == [False, False, False, True, True, True]
    assert sample.behaviour_logprobs == [None, None, None, -0.1, -0.2, -0.3]
    assert sample.advantage == 0.5 and not report.counts


def test_every_assistant_turn_trains_in_place_or_in_a_sample_of_its_own() -> None:
    """An agent episode: a tool call the template renders back as sampled trains inside the final sample; one it
    renders otherwise trains as its own sample (its prompt plus its reply); all carry the episode's advantage."""
    user = {"role": "user", "content": "q"}
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "function": {"name": "f"}}]}
    result = {"role": "tool", "tool_call_id": "c1", "content": "r"}
    in_place = Turn([user], call, [1, 2], [5, 6], [-0.4, -0.6])
    elsewhere = Turn([user, call, result], call, [1, 2, 5, 6, 3, 4], [9, 9], None)
    t = trajectory(
        0,
        1.0,
        context=[user, call, result, call, result],
        prompt_token_ids=[1, 2, 5, 6, 3, 4, 8, 8, 3, 4],
        earlier=[in_place, elsewhere],
    )
    report = DataReport()
    own, final = tokenize(t, 0.5, Template(), TrainConfig(), report)
    assert own.input_ids == [1, 2, 5, 6, 3, 4, 9, 9] and own.loss_mask == [False] * 6 + [True, True]
    assert final.input_ids == [1, 2, 5, 6, 3, 4, 8, 8, 3, 4, 7, 8, 9]
    assert final.loss_mask == [False, False, True, True] + [False] * 6 + [True] * 3
    assert final.behaviour_logprobs[2:4] == [-0.4, -0.6]
    assert own.advantage == final.advantage == 0.5
    assert report.as_dict() == {
        "no_behaviour_logprobs": 1,
        "samples_of_several_turn_episodes": 2,
        "turns_of_several_turn_episodes": 3,
    }


def test_turns_before_the_start_are_the_task_unless_whole_episodes_are_compared() -> None:
    """In a `resample` group the members share everything before the agent's part (an earlier exchange with
    the user); `key` and `prompt` groups compare whole episodes, so every turn trains."""
    earlier = Turn(
        [{"role": "user", "content": "hi"}], {"role": "assistant", "content": "yo"}, [1], [5], None
    )
    context = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "q"},
    ]
    t = trajectory(0, 1.0, context=context, prompt_token_ids=[1, 5, 3], earlier=[earlier])
    assert t.start == context and t.agent_turns == []
    [agent] = tokenize(t, 1.0, Template(), TrainConfig(), DataReport())
    [whole] = tokenize(t, 1.0, Template(), TrainConfig(), DataReport(), turns="all")
    assert agent.loss_mask == [False, False, False, True, True, True]
    assert whole.loss_mask == [False, True, False, True, True, True]


def test_missing_ids_fall_back_to_the_template_with_unknown_logprobs() -> None:
    report = DataReport()
    t = trajectory(0, 1.0, prompt_token_ids=None, completion_token_ids=None, completion_logprobs=None)
    [sample] = tokenize(t, 1.0, Template(), TrainConfig(), report)
    # prompt [100, 1, 101] from the template; the reply is re-encoded text plus end of turn
    assert sample.input_ids == [100, 1, 101, ord("a"), 2]
    assert sample.loss_mask == [False, False, False, True, True]
    assert sample.behaviour_logprobs == [None] * 5
    assert report.as_dict() == {"retokenised": 1}


@pytest.mark.parametrize(("overlong", "kept"), [("truncate", True), ("drop", False)])
def test_overlong_trajectories_are_truncated_or_dropped(overlong: str, kept: bool) -> None:
    report = DataReport()
    t = trajectory(
        0, 1.0, prompt_token_ids=list(range(20)), completion_token_ids=[7] * 10, completion_logprobs=None
    )
    samples = tokenize(t, 1.0, Template(), TrainConfig(max_length=25, overlong=overlong), report)  # type: ignore[arg-type]
    assert bool(samples) == kept
    if samples:
        [sample] = samples
        assert len(sample.input_ids) == 25 and sum(sample.loss_mask) == 5
        assert report.as_dict() == {"no_behaviour_logprobs": 1, "truncated_overlong": 1}
    else:
        assert report.as_dict() == {"dropped_overlong": 1, "no_behaviour_logprobs": 1}


def test_config_reads_policy_settings_and_rejects_unknown_keys() -> None:
    config = {"train": {"learning_rate": 1e-4, "grouping": "key"}}
    cfg = load_policy_config(config, train_overrides={"epochs": 2}).train
    assert (cfg.learning_rate, cfg.grouping, cfg.epochs, cfg.lora_rank) == (1e-4, "key", 2, 16)
    with pytest.raises(InvalidPolicyConfig, match=r"train\.lerning_rate: unknown key"):
        load_policy_config({"train": {"lerning_rate": 1}})
    with pytest.raises(InvalidPolicyConfig, match=r"train\.epochs"):
        load_policy_config(config, train_overrides={"epochs": 0})
    assert TrainConfig(collapse_bounds={"max_kl_to_base": 1.0}).bounds().max_kl_to_base == 1.0
