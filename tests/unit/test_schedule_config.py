"""The scheduler's catch-up arithmetic after a restart, retention's choice of versions, and the gate's checks."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from storage.episodes import Trajectory
from storage.jobs import RunInfo
from storage.policies import AdapterInfo
from storage.retention import versions_to_keep
from trainer import gate
from trainer.collapse import CollapseBounds, measure
from trainer.gate import Context, VersionSampler, collapse_problems, context_seed, is_held_out
from trainer.policy_config import GateConfig, ScheduleConfig
from trainer.scheduler import catch_up_time, missed_fire_time, previous_fire_time, schedule_slot
from trainer.scoring import GroupScore, Score

NOW = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)


def test_interval_catch_up_runs_once_now_after_downtime() -> None:
    assert catch_up_time(None, NOW, 60) == NOW + timedelta(seconds=60)  # never ran: one interval from now
    assert catch_up_time(NOW - timedelta(seconds=20), NOW, 60) == NOW + timedelta(seconds=40)
    assert catch_up_time(NOW - timedelta(seconds=600), NOW, 60) == NOW  # ten missed: one run, now


def test_cron_missed_only_when_a_fire_time_passed_since_the_last_run() -> None:
    nightly = "0 3 * * *"
    # The first firing after the last run: what a catch-up run stands for.
    assert missed_fire_time(nightly, NOW - timedelta(days=3), NOW) == NOW.replace(hour=3) - timedelta(days=2)
    assert missed_fire_time(nightly, NOW.replace(hour=3, minute=0), NOW) is None  # ran at 03:00 today
    assert missed_fire_time(nightly, None, NOW) is None


def test_a_firing_is_one_slot_for_every_replica() -> None:
    every_minute, nightly = "* * * * *", "0 3 * * *"
    late = NOW + timedelta(seconds=42)
    assert previous_fire_time(every_minute, late, 3600) == NOW
    assert previous_fire_time(every_minute, NOW, 3600) == NOW  # a firing at exactly now is its own slot
    assert previous_fire_time(nightly, NOW, 3600) is None  # 03:00 is beyond the look-back
    assert previous_fire_time(nightly, NOW, 10 * 3600) == NOW.replace(hour=3)
    config = ScheduleConfig(judge_interval_s=600, train_cron=every_minute)
    assert schedule_slot(config, "judge", "interval", late) == late - timedelta(seconds=300)
    assert schedule_slot(config, "train", "cron", late) == NOW
    assert schedule_slot(config, "train", "threshold", late) is None  # re-counted, not a slot
    assert schedule_slot(config, "judge", "manual", late) is None


def _adapter(version: int, status: str, pinned: bool = False) -> AdapterInfo:
    return AdapterInfo(1, version, status, f"/a/{version}", None, pinned, {}, NOW)


def test_retention_keeps_active_pinned_newest_and_rollback_target() -> None:
    adapters = [
        _adapter(0, "retired"),
        _adapter(1, "retired", pinned=True),
        _adapter(2, "retired"),
        _adapter(3, "active"),
        _adapter(4, "rejected"),
        _adapter(5, "retired"),
        _adapter(6, "candidate"),
        _adapter(7, "candidate"),
    ]
    assert versions_to_keep(adapters, 3, keep=2) == {1, 2, 3, 6, 7}


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

    async def sample(config: GateConfig, seed: int | None) -> list[dict[str, Any]]:
        sampler = VersionSampler("http://gateway/v1", None, config)
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            return await sampler.sample(
                client, "p@1", Context("g", [{"role": "user", "content": "q"}], None), seed
            )

    assert asyncio.run(sample(GateConfig(seed=7, samples=3), 7)) == [{"role": "assistant", "content": "Red."}]
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
        ) -> list[dict[str, Any]]:
            asked.append((model, context.group, seed))
            return [{"role": "assistant", "content": "Red."}] * 2

    class Scorer:
        async def score(self, trajectories: list[Trajectory]) -> GroupScore:
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
