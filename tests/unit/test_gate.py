"""The evaluation gate: which groups are held out, the collapse check against the active version, and the
seeded, paired sampling of both versions."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from storage.episodes import EpisodeTranscript
from storage.jobs import RunInfo
from trainer.control import gate
from trainer.control.collapse import CollapseBounds, measure
from trainer.control.gate import Context, VersionSampler, collapse_problems, context_seed, is_held_out
from trainer.control.policy_config import GateConfig
from trainer.control.scoring import GroupScore, Score

NOW = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)


def test_held_out_groups_are_a_stable_fraction() -> None:
    groups = [f"task-{i}" for i in range(2000)]
    held = [g for g in groups if is_held_out(g, 0.1)]
    assert 150 < len(held) < 250
    assert held == [g for g in groups if is_held_out(g, 0.1)]
    assert not any(is_held_out(g, 0.0) for g in groups)


def test_gate_collapse_check_is_relative_to_the_active_version() -> None:
    bounds = GateConfig().bounds()
    assert bounds == CollapseBounds()
    active = measure(["Red, orange and yellow.", "Blue, green, red.", "Violet and indigo.", "Green."])
    collapsed = measure(["ok ok ok ok ok ok", "ok ok ok ok ok ok", "ok ok ok ok ok ok", "ok ok ok ok ok ok"])
    problems = collapse_problems(collapsed, active, bounds)
    assert any(p.startswith("distinct_share") for p in problems)
    assert any(p.startswith("repetition") for p in problems)
    assert collapse_problems(active, active, bounds) == []
    # An empty-reply habit the active version shares is not held against the candidate.
    both_empty = measure(["", "Red.", "Blue and green.", "Yellow."])
    assert collapse_problems(both_empty, both_empty, bounds) == []


def test_gate_samples_with_its_seed_and_without_one_when_unset() -> None:
    bodies: list[dict[str, Any]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": "Red."}}]})

    async def sample(config: GateConfig, seed: int | None) -> list[list[dict[str, Any]]]:
        sampler = VersionSampler("http://gateway/v1", None, config)
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            return await sampler.sample(
                client, "p@1", Context("g", [{"role": "user", "content": "q"}], None), seed
            )

    assert asyncio.run(sample(GateConfig(seed=7, samples=3), 7)) == [
        [{"role": "assistant", "content": "Red."}]
    ]
    assert asyncio.run(sample(GateConfig(), None))
    assert [(b.get("seed"), b["n"]) for b in bodies] == [(7, 3), (None, 4)]
    assert "seed" not in bodies[1]
    with pytest.raises(ValidationError, match="seed"):
        GateConfig(seed=-1)


def test_gate_asks_both_versions_each_context_with_one_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A paired comparison: the candidate and the active version answer a context with the same seed, which comes
    from `gate.seed` and the context alone (not from its place among the contexts evaluated)."""
    contexts = [Context(f"g{i}", [{"role": "user", "content": f"q{i}"}], None) for i in range(3)]

    async def held_out(*args: Any) -> list[Context]:
        return contexts

    asked: list[tuple[str, str, int | None]] = []

    class Sampler:
        async def sample(
            self, client: httpx.AsyncClient, model: str, context: Context, seed: int | None = None
        ) -> list[list[dict[str, Any]]]:
            asked.append((model, context.group, seed))
            return [[{"role": "assistant", "content": "Red."}]] * 2

    class Scorer:
        async def score(self, trajectories: list[EpisodeTranscript]) -> GroupScore:
            return GroupScore("function", "f", None, [Score(t.episode_id, 1.0, None) for t in trajectories])

    monkeypatch.setattr(gate, "held_out_contexts", held_out)
    run = RunInfo(5, "p", "train", "succeeded", 0, 1, {}, {}, None, NOW, NOW)

    def seeds(config: GateConfig) -> dict[str, set[int | None]]:
        """The seeds each context was sampled with, by both versions."""
        asked.clear()
        result = asyncio.run(
            gate.evaluate(None, "p", run, 1, 0, scorer=Scorer(), sampler=Sampler(), config=config)  # type: ignore[arg-type]
        )
        assert result.passed and result.groups == 3
        assert sorted(model for model, _, _ in asked) == ["p@0"] * 3 + ["p@1"] * 3
        by_context: dict[str, set[int | None]] = {}
        for _, group, seed in asked:
            by_context.setdefault(group, set()).add(seed)
        return by_context

    first = seeds(GateConfig(seed=11))
    assert all(len(s) == 1 for s in first.values())  # one seed per context, for both versions
    assert len({seed for s in first.values() for seed in s}) == 3  # and another for each context
    assert all(0 <= seed < 2**31 for s in first.values() for seed in s if seed is not None)
    contexts.reverse()
    assert seeds(GateConfig(seed=11)) == first  # evaluated in another order: the same draws
    assert seeds(GateConfig(seed=12)) != first
    assert seeds(GateConfig()) == {f"g{i}": {None} for i in range(3)}
    assert context_seed(None, contexts[0]) is None
    assert context_seed(11, contexts[0]) == context_seed(11, Context("other", contexts[0].messages, None))


def test_an_agent_task_is_attempted_whole_by_both_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    """The held-out task of an agent episode: each version's attempt calls the tool (answered for real here),
    reads its result and answers; the scorer sees whole conversations, and the candidate that uses the tool
    wins over the active version that guesses."""
    from tests.unit.test_rollouts import TOOLS, USER, Tools

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        last = body["messages"][-1]
        if (
            body["model"] == "p@1" and last["role"] == "user"
        ):  # the candidate calls the tool, forced as captured
            assert body["tool_choice"] == "required"
            call = {
                "id": "c1",
                "type": "function",
                "function": {"name": "lookup", "arguments": '{"key": "zorland"}'},
            }
            message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
        elif last["role"] == "tool":
            message = {"role": "assistant", "content": last["content"].removeprefix("capital: ")}
        else:
            message = {"role": "assistant", "content": "Paris"}
        return httpx.Response(
            200, json={"choices": [{"message": message, "finish_reason": "stop"}] * body["n"]}
        )

    context = Context("g", [USER], TOOLS, [{"tool_choice": "required"}, {"tool_choice": "auto"}])

    async def held_out(*args: Any) -> list[Context]:
        return [context]

    judged: list[list[dict[str, Any]]] = []

    class Scorer:
        async def score(self, trajectories: list[EpisodeTranscript]) -> GroupScore:
            judged.extend(t.messages for t in trajectories)
            right = [float(t.messages[-1]["content"] == "Quix") for t in trajectories]
            return GroupScore(
                "function",
                "f",
                None,
                [Score(t.episode_id, r, None) for t, r in zip(trajectories, right, strict=True)],
            )

    monkeypatch.setattr(gate, "held_out_contexts", held_out)
    monkeypatch.setattr(httpx, "AsyncClient", _mocked(answer))
    run = RunInfo(5, "p", "train", "succeeded", 0, 1, {}, {}, None, NOW, NOW)
    config = GateConfig(samples=2, collapse_bounds={"min_distinct_share": 0.0})
    sampler = VersionSampler("http://gateway/v1", None, config, tools=Tools())
    result = asyncio.run(gate.evaluate(None, "p", run, 1, 0, scorer=Scorer(), sampler=sampler, config=config))  # type: ignore[arg-type]
    assert (result.candidate_reward, result.active_reward, result.decision) == (1.0, 0.0, "promote")
    candidate = [m for m in judged if len(m) == 4]
    assert len(candidate) == 2 and candidate[0][2] == {
        "role": "tool",
        "tool_call_id": "c1",
        "content": "capital: Quix",
    }


def _mocked(handler: Any) -> Any:
    """httpx.AsyncClient answering through `handler`, for code that builds its own client."""
    real = httpx.AsyncClient

    def make(*args: Any, **kwargs: Any) -> httpx.AsyncClient:
        kwargs.pop("transport", None)
        return real(*args, transport=httpx.MockTransport(handler), **kwargs)

    return make


def test_gate_attempts_contexts_at_once_up_to_its_concurrency(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine batches what it is asked at once, so contexts are attempted `gate.concurrency` at a time; the
    result is taken in the contexts' order, whichever finished first, and a failing context fails the gate."""
    contexts = [Context(f"g{i}", [{"role": "user", "content": f"q{i}"}], None) for i in range(5)]

    async def held_out(*args: Any) -> list[Context]:
        return contexts

    in_flight: set[str] = set()
    most: list[int] = [0]

    class Sampler:
        async def sample(
            self, client: httpx.AsyncClient, model: str, context: Context, seed: int | None = None
        ) -> list[list[dict[str, Any]]]:
            in_flight.add(context.group)
            most[0] = max(most[0], len(in_flight))
            # Later contexts finish first.
            await asyncio.sleep(0.01 * (len(contexts) - int(context.group[1:])))
            in_flight.discard(context.group)
            return [[{"role": "assistant", "content": f"{model} {context.group}"}]]

    class Scorer:
        def __init__(self, fail: str | None = None) -> None:
            self.fail = fail

        async def score(self, trajectories: list[EpisodeTranscript]) -> GroupScore:
            if any(t.group_key == self.fail for t in trajectories):
                return GroupScore("function", "f", None, None, error="it broke")
            # The candidate wins the first context only: any mix-up of contexts changes the means.
            return GroupScore(
                "function",
                "f",
                None,
                [
                    Score(t.episode_id, float(t.messages[-1]["content"] == "p@1 g0"), None)
                    for t in trajectories
                ],
            )

    monkeypatch.setattr(gate, "held_out_contexts", held_out)
    run = RunInfo(5, "p", "train", "succeeded", 0, 1, {}, {}, None, NOW, NOW)

    def evaluate(config: GateConfig, scorer: Scorer) -> gate.GateResult:
        most[0] = 0
        return asyncio.run(
            gate.evaluate(None, "p", run, 1, 0, scorer=scorer, sampler=Sampler(), config=config)  # type: ignore[arg-type]
        )

    result = evaluate(GateConfig(concurrency=2), Scorer())
    assert most[0] == 2
    assert (result.candidate_reward, result.active_reward, result.passed) == (0.2, 0.0, True)
    assert evaluate(GateConfig(), Scorer()).candidate_reward == 0.2 and most[0] == 5
    failed = evaluate(GateConfig(), Scorer(fail="g3"))
    assert not failed.passed and failed.reasons == ["scoring failed on group g3: it broke"]
    with pytest.raises(ValidationError):
        GateConfig(concurrency=0)
