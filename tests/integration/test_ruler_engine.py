"""RULER with the embedded model as judge, through the real engine and through Kaizen's own gateway: the offline
path end to end. A 135M model is no good judge, so this asserts structure, not quality."""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import VLLMServer, query
from trainer.control.ruler import JudgeSettings, judge_group

pytestmark = pytest.mark.vllm

CONTEXT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]
ATTEMPTS = [
    [*CONTEXT, {"role": "assistant", "content": "The capital of France is Paris."}],
    [*CONTEXT, {"role": "assistant", "content": "I think it is Berlin."}],
    [*CONTEXT, {"role": "assistant", "content": "Paris."}],
]


@pytest.mark.parametrize("through", ["engine", "gateway"])
def test_embedded_model_judges_a_group(vllm_server: VLLMServer, through: str) -> None:
    base = vllm_server.url if through == "engine" else vllm_server.gateway.url + "/v1"
    settings = JudgeSettings(
        model=vllm_server.model, api_base=base, timeout_s=300, max_retries=2, backoff_s=0.1, max_tokens=400
    )
    outcome = asyncio.run(judge_group(ATTEMPTS, ["a", "b", "c"], "Correct answers score higher.", settings))
    assert outcome.error is None, outcome.error
    assert outcome.judgements is not None
    assert [j.trajectory_id for j in outcome.judgements] == ["a", "b", "c"]
    assert all(0.0 <= j.score <= 1.0 and isinstance(j.explanation, str) for j in outcome.judgements)
    assert outcome.latency_ms > 0 and 1 <= outcome.attempts <= 3
    if through == "gateway":  # judge calls carry X-Kaizen-No-Log: they never become training data
        vllm_server.gateway.flush()
        db = vllm_server.gateway.settings.database_url
        stored = query(db, "SELECT request FROM calls")
        assert not any("Score each of the 3 trajectories" in str(row["request"]) for row in stored)
