"""`resample` grouping on the real vLLM engine: the extra replies are sampled through the live gateway from the
active version, carry the engine's exact token ids and behaviour logprobs, and are never captured as traffic."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gateway.scheduling import gate_url
from storage.database import Database
from tests.conftest import VLLMServer, query
from tests.integration.test_gate import make_policy, rewarded_traffic, run
from tests.support.engine_text import engine_text
from tests.support.training_data import NO_COLLAPSE_BOUNDS
from trainer.control.rewards import policy_reward_config
from trainer.control.rollouts import SampledTurn
from trainer.control.scoring import Scorer
from trainer.learner.engine_sampling import EngineEndpoint, EngineSampler
from trainer.learner.grouping import PolicyReplyScorer
from trainer.learner.job import TrainOutcome, TrainRequest, run_training

pytestmark = pytest.mark.vllm

PROMPTS = [
    "Name a colour. Reply with one word only.",
    "Name an animal. Reply with one word only.",
    "Name a fruit. Reply with one word only.",
]
GROUP_SIZE = 4
CONFIG = {
    "rewards": {"scorer": {"function": "tests.integration.test_train_engine_resample:brevity"}},
    "gate": {"holdout_fraction": 0.0},
    "train": {
        "grouping": "resample",
        "group_size": GROUP_SIZE,
        "resample_max_group_size": GROUP_SIZE,  # one round: each context gets exactly k-1 replies
        "max_new_tokens": 16,
        "learning_rate": 1e-5,
        "micro_batch_size": 8,
        "grad_accumulation": 1,
        "collapse_check_every": 0,
        "collapse_prompts": 1,
        "collapse_samples": 2,
        "collapse_max_new_tokens": 8,
        "collapse_bounds": NO_COLLAPSE_BOUNDS,
    },
}


def brevity(trajectory: dict[str, Any]) -> float:
    """The policy's reward function for resampled replies: shorter is better."""
    words = len((trajectory["messages"][-1].get("content") or "").split())
    return 1.0 / words if words else 0.0


def captured(server: VLLMServer, name: str) -> list[dict[str, Any]]:
    server.gateway.flush()
    rows = query(
        server.gateway.settings.database_url,
        "SELECT request, prompt_token_ids FROM calls WHERE policy = :policy",
        policy=name,
    )
    return [{k: json.loads(v) if isinstance(v, str) else v for k, v in row.items()} for row in rows]


class RecordingSampler(EngineSampler):
    """The real engine sampler, keeping what it returned so the test can look at the exact tokens."""

    recorded: list[tuple[list[dict[str, Any]], list[SampledTurn]]]

    async def sample(
        self,
        messages: list[dict[str, Any]],
        tools: list[Any] | None,
        n: int,
        options: Mapping[str, Any] | None = None,
    ) -> list[SampledTurn]:
        samples = await super().sample(messages, tools, n, options)
        self.recorded.append((messages, samples))
        return samples


@dataclass(frozen=True)
class RecordingEndpoint(EngineEndpoint):
    samplers: list[RecordingSampler] = field(default_factory=list)

    def sampler(self, model: str, tokenizer: Any, *, max_tokens: int, temperature: float) -> EngineSampler:
        sampler = RecordingSampler(self, model, tokenizer, max_tokens=max_tokens, temperature=temperature)
        sampler.recorded = []
        self.samplers.append(sampler)
        return sampler


def test_resampled_replies_come_from_the_engine_with_exact_tokens_and_are_not_logged(
    vllm_server: VLLMServer, embedded_model: Path
) -> None:
    from transformers import AutoTokenizer

    settings = vllm_server.gateway.settings
    make_policy(vllm_server, "engine-resample", CONFIG)
    rewarded_traffic(vllm_server, "engine-resample", PROMPTS, value=0.5)
    before = captured(vllm_server, "engine-resample")
    assert len(before) == len(PROMPTS)
    # Built like `kaizen train` builds it in the gateway's training child.
    endpoint = RecordingEndpoint(gate_url(settings), max_n=settings.max_n)

    async def train(database: Database) -> TrainOutcome:
        async with database.session() as session:
            reward_config = await policy_reward_config(session, "engine-resample")
        request = TrainRequest(
            "engine-resample",
            settings.data_dir,
            str(embedded_model),
            scorer=PolicyReplyScorer(Scorer(reward_config, settings.judge()), "engine-resample"),
            sampler=endpoint,
            device="cpu",
        )
        return await run_training(database, request)

    outcome: TrainOutcome = run(vllm_server, train)
    assert outcome.status == "succeeded", outcome.error
    [sampler] = endpoint.samplers
    assert sampler.model == "engine-resample@0"
    assert len(sampler.recorded) == len(PROMPTS)
    # Every rollout drawn is in a group but those the token limit cut (left out, counted).
    data = outcome.metrics["data"]
    assert data["resampled_replies"] + data.get("rollouts_truncated", 0) == len(PROMPTS) * (GROUP_SIZE - 1)
    resampling = outcome.metrics["resample"]
    assert resampling["replies"] == len(PROMPTS) * (GROUP_SIZE - 1) and resampling["rounds"] == 1
    assert resampling["contexts"] == len(PROMPTS)
    assert resampling["groups_with_signal"] == outcome.metrics["groups"]
    assert outcome.metrics["resampled_trajectories"] > 0
    assert "retokenised" not in outcome.metrics["data"]

    tokenizer = AutoTokenizer.from_pretrained(embedded_model)
    engine_prompts = {row["request"]["messages"][0]["content"]: row["prompt_token_ids"] for row in before}
    for messages, samples in sampler.recorded:
        assert len(samples) == GROUP_SIZE - 1
        for sample in samples:
            assert sample.token_ids and sample.logprobs is not None
            assert len(sample.logprobs) == len(sample.token_ids)
            assert all(math.isfinite(lp) and lp <= 0.0 for lp in sample.logprobs)
            assert engine_text(tokenizer, sample.token_ids) == sample.text
            # The template context the trainer uses is the prompt the engine sampled from.
            assert sample.prompt_token_ids == engine_prompts[messages[0]["content"]]

    # The resamples (and nothing else) went through the gateway unlogged: the captured calls are unchanged.
    assert captured(vllm_server, "engine-resample") == before


def test_the_gateways_training_child_resamples_through_the_gateway(vllm_server: VLLMServer) -> None:
    """The scheduled path: `kaizen train` as the gateway's child, with the gateway's settings, finds it."""
    make_policy(vllm_server, "child-resample", CONFIG)
    rewarded_traffic(vllm_server, "child-resample", PROMPTS, value=0.5)
    before = captured(vllm_server, "child-resample")
    jobs = vllm_server.gateway.services.jobs
    outcome = vllm_server.gateway.call(jobs.runner.run("child-resample", "train"), timeout_s=280)
    assert outcome is not None and outcome.kind == "train"
    assert outcome.to_version == 1, (outcome.status, outcome.error)  # the gate decides on it afterwards
    data = outcome.metrics["data"]
    assert data["resampled_replies"] + data.get("rollouts_truncated", 0) == len(PROMPTS) * (GROUP_SIZE - 1)
    assert outcome.metrics["resampled_trajectories"] > 0 and "retokenised" not in data
    assert captured(vllm_server, "child-resample") == before
