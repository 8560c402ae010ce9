"""SFT on what went well: which replies are demonstrations, how a run's modes become phases, and the update loop
training demonstrations with the SFT loss beside GRPO attempts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from trainer.control.policy_config import TrainConfig
from trainer.learner.batch import TokenizedSample, collate
from trainer.learner.dataset import DataReport, TrainingExample
from trainer.learner.grpo import _forward_logprobs, run_update
from trainer.learner.model import load_policy
from trainer.learner.sft import VOUCHED, PhaseMetrics, plan_phases, select_demonstrations


def example(episode: str, task: str, reply: str, reward: float, origin: str = "captured") -> TrainingExample:
    return TrainingExample(
        episode_id=episode,
        context=[{"role": "user", "content": task}],
        tools=None,
        reply={"role": "assistant", "content": reply},
        reward=reward,
        prompt_token_ids=None,
        completion_token_ids=None,
        completion_logprobs=None,
        group_key=task,
        origin=origin,
    )


def test_demonstrations_are_the_best_replies_per_task_above_the_bar() -> None:
    candidates = [
        example("a1", "color", "Blue", 1.0),
        example("a2", "color", "Red", 0.9),
        example("a3", "color", "Blue", 1.0, origin="resampled"),  # the same reply to the same task
        example("a4", "color", "I like green", 0.2),  # below the bar
        example("b1", "fruit", "Apple", 0.8),
        example("c1", "planet", "Mars", 0.0, origin=VOUCHED),  # imported: no reward, vouched for
        example("c2", "planet", "Venus", 0.95),
    ]
    report = DataReport()
    cfg = TrainConfig(sft_min_reward=0.8, sft_per_context=1)
    chosen = select_demonstrations(candidates, cfg, report)
    assert [e.episode_id for e in chosen] == ["c1", "a1", "b1"]
    assert report.as_dict() == {
        "sft_candidates": 7,
        "sft_below_min_reward": 1,
        "sft_duplicate_replies": 1,
        "sft_beyond_per_context": 2,  # Red for color, Venus for planet
    }

    report = DataReport()
    cfg = TrainConfig(sft_min_reward=0.8, sft_per_context=2, sft_max_examples=3)
    chosen = select_demonstrations(candidates, cfg, report)
    assert [e.episode_id for e in chosen] == ["c1", "a1", "c2"]
    assert report.counts["sft_capped"] == 2  # Red and Apple, the lowest rewards, are beyond the cap


def _sample(ids: list[int], reply: int, demonstration: bool = False) -> TokenizedSample:
    mask = [False] * (len(ids) - reply) + [True] * reply
    return TokenizedSample(ids, mask, [None] * len(ids), 0.0, demonstration)


ATTEMPTS = [_sample([3, 4, 5, 6], 2), _sample([3, 7, 8, 9], 2)]
DEMOS = [_sample([3, 4, 10, 11, 12], 3, demonstration=True)]


@pytest.mark.parametrize(
    ("mode", "attempts", "demos", "phases"),
    [
        ("grpo", ATTEMPTS, DEMOS, [("grpo", 2)]),
        ("sft", [], DEMOS, [("sft", 1)]),
        ("sft", [], [], []),
        ("warm_start", ATTEMPTS, DEMOS, [("sft", 1), ("grpo", 2)]),
        ("warm_start", ATTEMPTS, [], [("grpo", 2)]),
        ("warm_start", [], DEMOS, [("sft", 1)]),
        ("mixed", ATTEMPTS, DEMOS, [("mixed", 3)]),
        ("mixed", [], [], []),
    ],
)
def test_modes_become_phases(
    mode: str, attempts: list[TokenizedSample], demos: list[TokenizedSample], phases: list[tuple[str, int]]
) -> None:
    cfg = TrainConfig.model_validate({"mode": mode, "learning_rate": 1e-5, "sft_learning_rate": 3e-4})
    planned = plan_phases(cfg, attempts, demos)
    assert [(p.name, len(p.samples)) for p in planned] == phases
    for phase in planned:
        sft = phase.name == "sft"
        assert phase.cfg.learning_rate == (3e-4 if sft else 1e-5)
        assert phase.cfg.epochs == (cfg.sft_epochs if sft else cfg.epochs)
        assert phase.sft_weight == (cfg.sft_coef if phase.name == "mixed" else 1.0)


def test_phase_metrics_add_up_counts_and_keep_each_phases_losses() -> None:
    merged = PhaseMetrics()
    merged.add("sft", {"steps": 2.0, "tokens": 100.0, "update_s": 1.0, "sft_tokens": 40.0, "sft_nll": 2.5})
    merged.add("grpo", {"steps": 3.0, "tokens": 300.0, "update_s": 3.0, "loss_tokens": 90.0, "loss": -0.1})
    total = merged.merged()
    assert {k: v for k, v in total.items() if k != "phases"} == {
        "steps": 5.0,
        "tokens": 400.0,
        "update_s": 4.0,
        "tokens_per_s": 100.0,
        "sft_tokens": 40.0,
        "sft_nll": 2.5,
        "loss_tokens": 90.0,
        "loss": -0.1,
    }
    assert [p["phase"] for p in total["phases"]] == ["sft", "grpo"]


def test_a_mixed_update_imitates_demonstrations_beside_the_attempts(tiny_model_dir: Path) -> None:
    cfg = TrainConfig(lora_rank=4, lora_alpha=8, learning_rate=1e-2, micro_batch_size=4, epochs=1)
    device = torch.device("cpu")
    model, _ = load_policy(str(tiny_model_dir), None, cfg, device)
    # Attempts with advantage 0 teach nothing: any change to the demonstration comes from the SFT term.
    samples = [*ATTEMPTS, *DEMOS]

    def demo_logprob() -> float:
        batch = collate(DEMOS, pad_id=0)
        with torch.no_grad():
            return float(_forward_logprobs(model, batch, device)[batch.loss_mask].sum())

    before = demo_logprob()
    result = run_update(model, samples, cfg, pad_id=0, device=device, sft_weight=1.0)
    assert demo_logprob() > before + 1e-3
    assert result.metrics["sft_tokens"] == 3.0 and result.metrics["loss_tokens"] == 4.0
    assert result.metrics["sft_nll"] > 0 and result.steps == 1

    # The same samples without the demonstration flag are attempts with advantage 0: nothing is learnt.
    still, _ = load_policy(str(tiny_model_dir), None, cfg, device)
    plain = [replace(s, demonstration=False) for s in samples]
    flat = run_update(still, plain, cfg, pad_id=0, device=device)
    assert "sft_tokens" not in flat.metrics and flat.metrics["loss_tokens"] == 7.0
