"""A candidate adapter that games its reward, trained in-process with Kaizen's own trainer pieces.

GRPO on a length-only reward (tests/support/gate_rewards.py `brevity`) at a high learning rate collapses the
embedded 135M model into empty replies within a few rounds: the reward keeps rising while the replies stop
answering anything. Measured on short questions (4 prompts x 8 samples, 16 new tokens, lr 1e-3): seeds 0-5
all reached empty replies, after 2 to 8 updates (most within 4). Not every run gets there: one CI run settled
on one-word answers ("Canada", 5 characters on average), where every sample of a group scores the same and GRPO
has no signal left, so a run that stalls is abandoned and the next seed tried. The evaluation-gate test
registers such an adapter as a candidate version.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from storage.episodes import EpisodeTranscript
from trainer.control.collapse import CollapseBounds, CollapseSignals, check, measure
from trainer.control.policy_config import TrainConfig
from trainer.learner.advantages import group_advantages, has_signal
from trainer.learner.dataset import DataReport, TrainingExample
from trainer.learner.grpo import run_update
from trainer.learner.model import LocalSampler, load_policy, save_adapter
from trainer.learner.tokens import tokenize

Reward = Callable[[dict[str, Any]], float]


@dataclass
class Round:
    """Fresh samples of the adapter as it stood before a round's update."""

    reward: float
    signals: CollapseSignals
    example: str


@dataclass
class HackedCandidate:
    rounds: list[Round] = field(default_factory=list)
    updates: int = 0

    @property
    def baseline(self) -> Round:
        """The starting adapter's samples."""
        return self.rounds[0]

    @property
    def final(self) -> Round:
        """The saved adapter's samples (the last round's update is skipped once it collapsed)."""
        return self.rounds[-1]

    def problems(self, bounds: CollapseBounds | None = None) -> list[str]:
        """The trainer's own collapse bounds, violated by the final samples relative to the starting ones."""
        return check(self.final.signals, bounds or CollapseBounds(), baseline=self.baseline.signals)


def train_until_collapsed(
    base_path: str,
    start: Path,
    target: Path,
    reward: Reward,
    prompts: Sequence[str],
    *,
    seeds: Sequence[int] = (0, 1, 2),
    min_empty_share: float = 0.9,
) -> HackedCandidate:
    """The first of `seeds` whose run collapses into (nearly) empty replies, saved at `target`; the last run
    tried if none does (the caller's assertions then show its rounds)."""
    if not seeds:
        raise ValueError("at least one seed")
    for seed in seeds:
        result = train_once(
            base_path, start, target, reward, prompts, min_empty_share=min_empty_share, seed=seed
        )
        if result.final.signals.empty_share >= min_empty_share:
            break
    return result


def train_once(
    base_path: str,
    start: Path,
    target: Path,
    reward: Reward,
    prompts: Sequence[str],
    *,
    learning_rate: float = 1e-3,
    samples: int = 8,
    max_new_tokens: int = 16,
    max_rounds: int = 12,
    min_empty_share: float = 0.9,
    seed: int = 0,
) -> HackedCandidate:
    """GRPO from the adapter at `start` on `reward` until most fresh samples are empty (or `max_rounds`
    updates ran, or a round's groups had no reward variance to learn from), then save the adapter to `target` (atomically, as the trainer writes versions).

    Each round samples `samples` replies per prompt at temperature 1 (what the trainer learns from), scores
    them with `reward` as the gate's scorer would, and takes one update on the groups with reward variance;
    one optimizer step per micro-batch of 8 makes the high learning rate bite within a few rounds.
    """
    cfg = TrainConfig(
        learning_rate=learning_rate,
        micro_batch_size=8,
        grad_accumulation=1,
        max_new_tokens=max_new_tokens,
        collapse_check_every=0,
        seed=seed,
    )
    device = torch.device("cpu")
    model, tokenizer = load_policy(base_path, str(start), cfg, device)
    sampler = LocalSampler(model, tokenizer, device, max_new_tokens=max_new_tokens)
    contexts = [[{"role": "user", "content": prompt}] for prompt in prompts]
    result = HackedCandidate()
    try:
        for round_index in range(max_rounds + 1):
            torch.manual_seed(seed + round_index)
            groups = sampler.sample_many([(context, None) for context in contexts], samples)
            texts, owners, scored = [], [], []
            for index, (context, group) in enumerate(zip(contexts, groups, strict=True)):
                rewards = [
                    reward(
                        EpisodeTranscript(
                            f"hack-{round_index}-{index}-{j}",
                            [*context, {"role": "assistant", "content": sample.text}],
                        ).as_dict()
                    )
                    for j, sample in enumerate(group)
                ]
                texts += [sample.text for sample in group]
                owners += [index] * len(group)
                scored.append(rewards)
            everything = [value for rewards in scored for value in rewards]
            signals = measure(texts, contexts=owners)
            result.rounds.append(Round(sum(everything) / len(everything), signals, texts[0]))
            if signals.empty_share >= min_empty_share or round_index == max_rounds:
                break
            batch = []
            for context, group, rewards in zip(contexts, groups, scored, strict=True):
                if not has_signal(rewards):
                    continue
                advantages = group_advantages(rewards, scale_by_std=cfg.scale_by_std)
                for sample, value, advantage in zip(group, rewards, advantages, strict=True):
                    trajectory = TrainingExample(
                        "hack",
                        context,
                        None,
                        {"role": "assistant", "content": sample.text},
                        value,
                        sample.prompt_token_ids,
                        sample.token_ids,
                        sample.logprobs,
                    )
                    batch.extend(tokenize(trajectory, advantage, tokenizer, cfg, DataReport()))
            if not batch:
                break
            run_update(model, batch, cfg, pad_id=int(tokenizer.pad_token_id), device=device)
            result.updates += 1
        save_adapter(model, target)
    finally:
        del model, sampler
        gc.collect()
    return result
