"""GRPO end to end on CPU with the embedded model: captured calls + rewards in SQL ▶ `run_training` ▶ adapter N+1.

The task is verifiable: "reply with one word", rewarded 1/words (0 for an empty reply). The data are replies the
model itself sampled (token ids and behaviour logprobs captured like the engine does), written through the
capture path; the fresh replies of the new adapter must earn more than those of the old one.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from migrations.runner import upgrade_database
from storage.database import Database
from storage.policies import create_policy, list_adapters
from tests.support.improvement import assert_rewards_improved, mean
from tests.support.training_data import RewardedReply, write_rewarded_groups
from trainer.control.policy_config import TrainConfig, load_policy_config
from trainer.control.ruler import JudgeSettings
from trainer.control.scoring import Scorer
from trainer.learner.grouping import PolicyReplyScorer
from trainer.learner.job import TrainingBusy, TrainRequest, run_training
from trainer.learner.model import LocalSampler, Sample, load_policy, pick_device

# Trains on every core: `make test` runs it on its own, never beside another test (README, "Test").
pytestmark = pytest.mark.serial

PROMPTS = [
    "Name a color. Reply with one word only.",
    "Name an animal. Reply with one word only.",
    "What is the capital of France? Reply with one word only.",
    "Name a fruit. Reply with one word only.",
    "Name a planet. Reply with one word only.",
    "Name a country. Reply with one word only.",
]
SAMPLES = 8
MAX_NEW_TOKENS = 24


def brevity(text: str) -> float:
    words = len(text.split())
    return 1.0 / words if words else 0.0


def train_settings() -> dict[str, Any]:
    return {
        "grouping": "key",
        "group_size": SAMPLES,
        "learning_rate": 2e-4,
        "epochs": 2,
        "micro_batch_size": 8,
        "grad_accumulation": 1,
        "loss_mode": "cispo",
        "max_new_tokens": MAX_NEW_TOKENS,
        "collapse_check_every": 0,
        "collapse_prompts": 2,
        "collapse_samples": 4,
        "collapse_max_new_tokens": 16,
        # No collapse bounds are loosened: shorter replies are the goal of this task, and the collapse checks
        # score their replies with the policy's scorer, so a policy that became terse because the reward asked
        # for it is not stopped as collapsed.
    }


def one_word(trajectory: dict[str, Any]) -> float:
    """The policy's reward function (its `scorer.function`): what the collapse checks score replies with."""
    return brevity(trajectory["messages"][-1].get("content") or "")


CONFIG = {
    "train": train_settings(),
    "rewards": {"scorer": {"function": "tests.integration.test_train_grpo:one_word"}},
}


def scored_request(data_dir: Path, embedded_model: Path) -> TrainRequest:
    """A CPU training request for `shortbot` whose collapse checks score replies with its reward function."""
    scorer = Scorer(load_policy_config(CONFIG).rewards, JudgeSettings(model=""))
    return TrainRequest(
        "shortbot", data_dir, str(embedded_model), scorer=PolicyReplyScorer(scorer, "shortbot"), device="cpu"
    )


def sampler(model_dir: Path, adapter: str | None, seed: int) -> LocalSampler:
    torch.manual_seed(seed)
    model, tokenizer = load_policy(str(model_dir), adapter, TrainConfig(seed=seed), pick_device())
    return LocalSampler(model, tokenizer, pick_device(), max_new_tokens=MAX_NEW_TOKENS)


def fresh_samples(s: LocalSampler) -> list[list[Sample]]:
    return s.sample_many([([{"role": "user", "content": p}], None) for p in PROMPTS], SAMPLES)


def rewards(samples: list[list[Sample]]) -> list[float]:
    return [brevity(x.text) for group in samples for x in group]


async def insert_data(db: Database, samples: list[list[Sample]], policy: str) -> None:
    """One episode per sampled reply, grouped per prompt by `group_key`, each with a `rule` reward."""
    groups = [
        (
            prompt,
            [
                RewardedReply(s.text, brevity(s.text), s.prompt_token_ids, s.token_ids, s.logprobs or None)
                for s in group
            ],
        )
        for prompt, group in zip(PROMPTS, samples, strict=True)
    ]
    await write_rewarded_groups(db, policy, groups, "brevity")


def test_training_raises_reward_of_fresh_samples(tmp_path: Path, embedded_model: Path) -> None:
    torch.set_num_threads(2)
    url = f"sqlite+aiosqlite:///{tmp_path / 'kaizen.db'}"

    old_samples = fresh_samples(sampler(embedded_model, None, seed=1))

    async def scenario() -> tuple[Any, list[Any]]:
        await upgrade_database(url)
        db = Database(url)
        try:
            async with db.session() as session:
                await create_policy(session, "shortbot", "smollm2-135m-instruct", CONFIG)
                await session.commit()
            await insert_data(db, old_samples, "shortbot")
            outcome = await run_training(db, scored_request(tmp_path / "data", embedded_model))
            async with db.session() as session:
                from storage.policies import get_policy

                policy = await get_policy(session, "shortbot")
                assert policy is not None
                adapters = await list_adapters(session, policy.id)
            return outcome, adapters
        finally:
            await db.dispose()

    outcome, adapters = asyncio.run(scenario())
    assert outcome.status == "succeeded", outcome.error
    metrics = outcome.metrics
    assert metrics["groups"] >= 4 and metrics["trajectories"] == metrics["samples"]
    assert metrics["loss_tokens"] > 0 and metrics["tokens_per_s"] > 0
    assert metrics["data"]["episodes_rewarded"] == len(PROMPTS) * SAMPLES
    assert "retokenised" not in metrics["data"]  # captured ids were used
    assert [(a.version, a.status) for a in adapters] == [(outcome.version, "candidate")]
    assert Path(outcome.adapter_path or "", "adapter_config.json").is_file()
    assert not [p for p in Path(outcome.adapter_path or "").parent.iterdir() if p.name.startswith(".")]

    # The policy moved as far as the reward asked: the last collapse check crossed movement bounds (shorter,
    # surer, far from where the run started) that its replies' higher reward waived.
    baseline, final = metrics["collapse"][0], metrics["collapse"][-1]
    print(f"collapse checks: {baseline} -> {final}")
    assert final["reward"] > baseline["reward"] and final["waived"], final

    # The captured replies are fresh samples of the old adapter (here: the base model) on the same prompts; the
    # new adapter's replies, seeded too, must earn more than their 48 replies a side can explain by chance.
    before = rewards(old_samples)
    after = rewards(fresh_samples(sampler(embedded_model, outcome.adapter_path, seed=7)))
    print(f"mean reward of fresh samples: before {mean(before):.3f} after {mean(after):.3f}")
    assert_rewards_improved(before, after)


@pytest.mark.usefixtures("embedded_model")
def test_second_run_of_a_policy_is_refused(tmp_path: Path) -> None:
    """The lock is in the database: a held, unexpired lock refuses the run before any work starts."""
    from storage.locks import acquire_lock
    from storage.policies import get_policy

    url = f"sqlite+aiosqlite:///{tmp_path / 'kaizen.db'}"

    async def scenario() -> None:
        await upgrade_database(url)
        db = Database(url)
        try:
            async with db.session() as session:
                await create_policy(session, "p", "base", {"train": {"grouping": "key"}})
                await session.commit()
                policy = await get_policy(session, "p")
                assert policy is not None
                assert await acquire_lock(session, "p", "other-job", "judge", ttl_s=60)
            with pytest.raises(TrainingBusy):
                await run_training(db, TrainRequest("p", tmp_path, "unused"))
        finally:
            await db.dispose()

    asyncio.run(scenario())
