"""SFT end to end on CPU with the embedded model: the best-rewarded replies (and imported conversations) in SQL ▶
`run_training` in `sft` mode ▶ adapter N+1, whose fresh replies earn more than the base model's.

The task is the GRPO test's "reply with one word" (reward 1/words). The data are the base model's own sampled
replies with their rewards, and imported one-word conversations stored without a reward (`source = "import"`);
only replies with full marks and the imported ones are demonstrations.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from migrations.runner import upgrade_database
from storage.database import Database
from storage.policies import create_policy
from tests.integration.test_train_grpo import (
    CONFIG,
    PROMPTS,
    SAMPLES,
    brevity,
    fresh_samples,
    insert_data,
    rewards,
    sampler,
    scored_request,
)
from tests.support.improvement import assert_rewards_improved, mean
from tests.support.training_data import write_demonstrations
from trainer.learner.job import run_training

# Trains on every core: `make test` runs it on its own, never beside another test (README, "Test").
pytestmark = pytest.mark.serial

IMPORTED = [(prompt, answer) for prompt, answer in zip(PROMPTS, ["Blue", "Cat", "Paris"], strict=False)]


def sft_settings() -> dict[str, Any]:
    return {
        "mode": "sft",
        "grouping": "key",
        "sft_min_reward": 1.0,
        "sft_per_context": 2,
        "sft_epochs": 3,
        "sft_learning_rate": 3e-4,
        "micro_batch_size": 8,
        "grad_accumulation": 1,
        "collapse_check_every": 0,
        "collapse_prompts": 2,
        "collapse_samples": 4,
        "collapse_max_new_tokens": 16,
        # No bound is loosened: the collapse checks score their replies with the policy's reward function, so
        # replies that became one word because the reward asks for it are not stopped as collapse.
    }


def test_sft_on_the_best_replies_raises_reward_of_fresh_samples(tmp_path: Path, embedded_model: Path) -> None:
    torch.set_num_threads(2)
    url = f"sqlite+aiosqlite:///{tmp_path / 'kaizen.db'}"
    old_samples = fresh_samples(sampler(embedded_model, None, seed=1))
    full_marks = sum(1 for group in old_samples for s in group if brevity(s.text) == 1.0)

    async def scenario() -> Any:
        await upgrade_database(url)
        db = Database(url)
        try:
            async with db.session() as session:
                config = {
                    "train": sft_settings(),
                    "rewards": CONFIG["rewards"],
                    "gate": {"holdout_fraction": 0.0},
                }
                await create_policy(session, "shortbot", "smollm2-135m-instruct", config)
                await session.commit()
            await insert_data(db, old_samples, "shortbot")
            await write_demonstrations(db, "shortbot", IMPORTED, source="import")
            request = scored_request(tmp_path / "data", embedded_model)
            return await run_training(db, request)
        finally:
            await db.dispose()

    outcome = asyncio.run(scenario())
    assert outcome.status == "succeeded", outcome.error
    metrics = outcome.metrics
    data = metrics["data"]
    assert metrics["mode"] == "sft" and metrics["samples"] == 0 and metrics["groups"] == 0
    # Every imported conversation, and at most two full-mark replies per prompt; nothing below full marks.
    assert data["demonstrations_unrewarded"] == len(IMPORTED)
    assert data["retokenised"] == len(IMPORTED)  # imported without token ids
    assert len(IMPORTED) < metrics["demonstrations"] <= len(IMPORTED) + min(full_marks, 2 * len(PROMPTS))
    assert data["sft_candidates"] == len(PROMPTS) * SAMPLES + len(IMPORTED)
    assert data["sft_below_min_reward"] == len(PROMPTS) * SAMPLES - full_marks
    assert metrics["sft_tokens"] > 0 and metrics["sft_nll"] > 0 and metrics["steps"] >= 3
    assert metrics["collapse"][-1]["step"] == metrics["steps"]

    before = rewards(old_samples)
    trained = sampler(embedded_model, outcome.adapter_path, seed=7)
    trained.model = trained.model.merge_and_unload()  # the same replies, sampled at the base model's speed
    after = rewards(fresh_samples(trained))
    print(
        f"mean reward of fresh samples: before {mean(before):.3f} after {mean(after):.3f} ({full_marks} full marks)"
    )
    assert_rewards_improved(before, after)
