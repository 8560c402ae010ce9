"""Closing the loop on the real vLLM engine: promotion and rollback under streaming load with no failed call,
a crashing training child that changes nothing that serves, and the evaluation gate rejecting a worse
candidate (and promoting an equal one)."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from gateway.base_models import resolve_base_model
from gateway.policies import create_policy_with_initial_adapter
from storage.database import Database
from storage.jobs import get_run, start_job_run, update_run
from storage.policies import (
    PolicyInfo,
    adapter_dir,
    add_adapter,
    get_adapter,
    get_policy,
    promote,
    rollback,
    update_policy_config,
)
from tests.conftest import VLLMServer, query
from tests.support.gate_rewards import brevity
from tests.support.reward_hacking import train_until_collapsed

pytestmark = pytest.mark.vllm

PROMPTS = [
    "Name three colours of the rainbow.",
    "What colour is the sky on a clear day? Answer in one word.",
    "What colour are ripe bananas? Answer in one word.",
]


def client(server: VLLMServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.gateway.url + "/v1", api_key="x", max_retries=0, timeout=120)


def run(server: VLLMServer, coro: Any) -> Any:
    async def wrapped() -> Any:
        database = Database(server.gateway.settings.database_url)
        try:
            return await coro(database)
        finally:
            await database.dispose()

    return asyncio.run(wrapped())


def make_policy(server: VLLMServer, name: str, config: dict[str, Any] | None = None) -> PolicyInfo:
    async def create(database: Database) -> PolicyInfo:
        return await create_policy_with_initial_adapter(
            database, server.data_dir, name, server.model, config or {}, actor="tests"
        )

    policy: PolicyInfo = run(server, create)
    deadline = time.monotonic() + 30
    while name not in {m.id for m in client(server).models.list().data}:
        assert time.monotonic() < deadline, f"{name} never appeared in /v1/models"
        time.sleep(0.2)
    return policy


def add_version(
    server: VLLMServer, policy: PolicyInfo, version: int, lora_b_scale: float | None = None
) -> None:
    """Version `version` as a copy of version 0; with `lora_b_scale`, its lora_B weights become large random
    values, so the adapter turns every reply into garbage."""
    source, target = (
        adapter_dir(server.data_dir, policy.name, 0),
        adapter_dir(server.data_dir, policy.name, version),
    )
    shutil.copytree(source, target)
    if lora_b_scale is not None:
        weights = target / "adapter_model.safetensors"
        tensors = load_file(weights)
        generator = torch.Generator().manual_seed(7)
        for key, tensor in tensors.items():
            if "lora_B" in key:
                tensors[key] = (torch.randn(tensor.shape, generator=generator) * lora_b_scale).to(
                    tensor.dtype
                )
        save_file(tensors, weights)

    async def register(database: Database) -> None:
        async with database.session() as session:
            await add_adapter(session, policy.id, version, str(target.resolve()), parent_version=0)
            await session.commit()

    run(server, register)


def active_version(server: VLLMServer, name: str) -> int | None:
    async def read(database: Database) -> int | None:
        async with database.session() as session:
            policy = await get_policy(session, name)
        return policy.active_version if policy is not None else None

    return run(server, read)  # type: ignore[no-any-return]


def test_promote_and_rollback_under_streaming_load_fail_no_call(vllm_server: VLLMServer) -> None:
    policy = make_policy(vllm_server, "live")
    add_version(vllm_server, policy, 1)
    stop = threading.Event()
    results: list[tuple[str, str | None, str | None]] = []  # (request id, finish reason, error)
    lock = threading.Lock()

    def stream_forever(worker: int) -> None:
        api = client(vllm_server)
        turn = 0
        while not stop.is_set():
            turn += 1
            try:
                raw = api.chat.completions.with_raw_response.create(
                    model="live",
                    messages=[
                        {"role": "user", "content": f"{PROMPTS[turn % len(PROMPTS)]} ({worker}.{turn})"}
                    ],
                    max_tokens=8,
                    stream=True,
                )
                finish = None
                for chunk in raw.parse():
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                outcome = (raw.headers["x-request-id"], finish, None)
            except Exception as exc:  # recorded and asserted on below
                outcome = ("", None, repr(exc))
            with lock:
                results.append(outcome)

    def served_versions() -> list[int]:
        rows = query(
            vllm_server.gateway.settings.database_url,
            "SELECT adapter_version FROM calls WHERE policy = 'live' ORDER BY created_at",
        )
        return [row["adapter_version"] for row in rows]

    def wait_until(condition: Any, what: str, timeout_s: float = 300) -> None:
        """Progress, not wall-clock sleeps, drives the test: a loaded CI machine may take seconds per call."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            assert all(error is None for _, _, error in results), results
            time.sleep(0.25)

    def more_calls(count: int) -> None:
        with lock:
            target = len(results) + count
        wait_until(lambda: len(results) >= target, f"{count} more completed calls")

    async def switch(database: Database, to: str) -> None:
        async with database.session() as session:
            await (promote(session, "live", 1) if to == "promote" else rollback(session, "live"))

    threads = [threading.Thread(target=stream_forever, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    try:
        more_calls(4)
        run(vllm_server, lambda db: switch(db, "promote"))
        wait_until(lambda: 1 in served_versions(), "a call served by version 1")
        more_calls(4)
        run(vllm_server, lambda db: switch(db, "rollback"))
        wait_until(
            lambda: 0 in (versions := served_versions())[versions.index(1) :],
            "a call served by version 0 again after the rollback",
        )
        more_calls(4)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=120)
    errors = [error for _, _, error in results if error is not None]
    assert not errors, errors[:3]
    assert len(results) >= 12 and all(finish in ("stop", "length") for _, finish, _ in results)
    vllm_server.gateway.flush()
    rows = query(
        vllm_server.gateway.settings.database_url,
        "SELECT adapter_version, status FROM calls WHERE policy = 'live' ORDER BY created_at",
    )
    assert {row["status"] for row in rows} == {"ok"}
    assert {row["adapter_version"] for row in rows} == {
        0,
        1,
    }  # served by version 1 after the promotion and by 0 again after the rollback
    versions = [r["adapter_version"] for r in rows]
    assert versions[-1] == 0 and 0 in versions[versions.index(1) :]
    assert active_version(vllm_server, "live") == 0


def test_a_crashing_training_child_changes_nothing_that_serves(vllm_server: VLLMServer) -> None:
    make_policy(vllm_server, "crashy")

    async def break_config(database: Database) -> None:
        async with database.session() as session:
            policy = await get_policy(session, "crashy")
            assert policy is not None
            await update_policy_config(session, policy.id, {"train": {"learning_rate": -1}})
            await session.commit()

    run(vllm_server, break_config)
    jobs = vllm_server.gateway.services.jobs
    outcome = vllm_server.gateway.call(jobs.runner.run("crashy", "train"), timeout_s=120)
    assert outcome is not None and outcome.kind == "train" and outcome.status == "failed"
    assert "learning_rate" in (outcome.error or ""), outcome.error
    assert outcome.metrics["exit_code"] != 0
    assert active_version(vllm_server, "crashy") == 0
    reply = client(vllm_server).chat.completions.create(
        model="crashy", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert reply.choices[0].finish_reason in ("stop", "length")


def rewarded_traffic(server: VLLMServer, name: str, prompts: list[str] = PROMPTS, value: float = 1.0) -> None:
    """Served calls with feedback: held-out material for the gate (newer than the run's data window), or the
    trajectories a training run selects."""
    api = client(server)
    for prompt in prompts:
        raw = api.chat.completions.with_raw_response.create(
            model=name, messages=[{"role": "user", "content": prompt}], max_tokens=16
        )
        server.gateway.flush()
        response = httpx.post(
            server.gateway.url + "/v1/feedback",
            json={"request_id": raw.headers["x-request-id"], "value": value},
            timeout=10,
        )
        assert response.status_code == 200, response.text


def finished_run(server: VLLMServer, policy: PolicyInfo, version: int) -> int:
    """A succeeded train run that wrote `version` and trained on data before any of this test's traffic."""

    async def create(database: Database) -> int:
        async with database.session() as session:
            run_id = await start_job_run(
                session,
                policy.id,
                "train",
                0,
                {"data_since": None, "data_until": "2000-01-01T00:00:00+00:00"},
            )
            await update_run(session, run_id, status="succeeded", to_version=version)
            await session.commit()
        return run_id

    return run(server, create)  # type: ignore[no-any-return]


# A low temperature keeps the base model on topic, so the active version reliably scores above zero; the seed has
# both versions answer each context on the same draws, the same in every run.
GATE = {"max_groups": 3, "samples": 3, "max_tokens": 24, "temperature": 0.3, "tolerance": 0.0, "seed": 3}
SCORER = {"rewards": {"scorer": {"function": "tests.support.gate_rewards:rainbow"}}}


def test_gate_rejects_a_worse_candidate_and_records_why(vllm_server: VLLMServer) -> None:
    policy = make_policy(vllm_server, "gated", {**SCORER, "gate": GATE})
    rewarded_traffic(vllm_server, "gated")
    add_version(vllm_server, policy, 1, lora_b_scale=5.0)
    run_id = finished_run(vllm_server, policy, 1)
    jobs = vllm_server.gateway.services.jobs
    result = vllm_server.gateway.call(jobs.runner.gate("gated", run_id), timeout_s=300)
    assert result.decision == "reject" and result.groups == 3
    assert result.candidate_reward is not None and result.active_reward is not None
    assert result.active_reward > 0 and result.candidate_reward < result.active_reward

    async def stored(database: Database) -> tuple[Any, Any]:
        async with database.session() as session:
            return await get_run(session, run_id), await get_adapter(session, policy.id, 1)

    saved, adapter = run(vllm_server, stored)
    assert saved.status == "rejected" and saved.metrics["gate"]["decision"] == "reject"
    assert saved.metrics["gate"]["reasons"] and saved.metrics["gate"]["candidate_signals"]["count"] == 9
    assert adapter.status == "rejected"
    assert active_version(vllm_server, "gated") == 0


def test_gate_promotes_a_candidate_that_is_not_worse(vllm_server: VLLMServer) -> None:
    policy = make_policy(vllm_server, "equal", {**SCORER, "gate": {**GATE, "temperature": 0.0}})
    rewarded_traffic(vllm_server, "equal")
    add_version(vllm_server, policy, 1)  # the same weights: greedy replies are identical
    run_id = finished_run(vllm_server, policy, 1)
    jobs = vllm_server.gateway.services.jobs
    result = vllm_server.gateway.call(jobs.runner.gate("equal", run_id), timeout_s=300)
    assert result.decision == "promote", result.reasons
    assert result.candidate_reward == result.active_reward
    assert active_version(vllm_server, "equal") == 1


# Short questions unlike PROMPTS (the gate asks those): the base model often answers these within the 16 tokens
# sampled, so replies differ in length from the first round and GRPO has a signal to game.
HACK_PROMPTS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What colour is grass? Answer in one word.",
    "Name a fruit.",
]
BREVITY = {"rewards": {"scorer": {"function": "tests.support.gate_rewards:brevity"}}}


def register_version(server: VLLMServer, policy: PolicyInfo, version: int, path: Path) -> None:
    resolved = str(path.resolve())

    async def register(database: Database) -> None:
        async with database.session() as session:
            await add_adapter(session, policy.id, version, resolved, parent_version=0)
            await session.commit()

    run(server, register)


@pytest.mark.timeout(900)  # training on a loaded 2-core CPU; about two minutes on an idle one
def test_gate_rejects_a_candidate_that_games_a_length_only_reward(vllm_server: VLLMServer) -> None:
    """Reward hacking: GRPO on `brevity` (shorter is better, nothing else counts) collapses the policy into
    empty replies, which score higher than the active version's real answers; the gate must still reject it
    on the collapse signals."""
    policy = make_policy(vllm_server, "hacked", {**BREVITY, "gate": GATE})
    rewarded_traffic(vllm_server, "hacked")
    target = adapter_dir(vllm_server.data_dir, "hacked", 1)
    hacked = train_until_collapsed(
        resolve_base_model(vllm_server.model, vllm_server.data_dir / "models"),
        adapter_dir(vllm_server.data_dir, "hacked", 0),
        target,
        brevity,
        HACK_PROMPTS,
    )
    # It really gamed the reward: fresh samples are (nearly) all empty and score higher than the starting ones.
    assert hacked.final.signals.empty_share >= 0.9, hacked.rounds
    assert hacked.final.reward > hacked.baseline.reward, hacked.rounds
    assert {p.split()[0] for p in hacked.problems()} >= {"empty_share", "mean_length"}, hacked.problems()
    register_version(vllm_server, policy, 1, target)
    run_id = finished_run(vllm_server, policy, 1)

    jobs = vllm_server.gateway.services.jobs
    result = vllm_server.gateway.call(jobs.runner.gate("hacked", run_id), timeout_s=300)
    assert result.decision == "reject" and result.groups == 3, result.reasons
    assert result.candidate_reward is not None and result.active_reward is not None
    assert result.candidate_reward > result.active_reward, result.reasons  # the reward alone would promote it
    assert result.reasons and all(r.startswith("collapse: ") for r in result.reasons), result.reasons
    flagged = {reason.removeprefix("collapse: ").split()[0] for reason in result.reasons}
    assert flagged >= {"empty_share", "distinct_share", "mean_length"}, result.reasons
    assert result.candidate_signals is not None and result.candidate_signals["empty_share"] == 1.0

    async def stored(database: Database) -> tuple[Any, Any]:
        async with database.session() as session:
            return await get_run(session, run_id), await get_adapter(session, policy.id, 1)

    saved, adapter = run(vllm_server, stored)
    assert saved.status == "rejected" and saved.metrics["gate"]["reasons"] == result.reasons
    assert adapter.status == "rejected"
    assert active_version(vllm_server, "hacked") == 0
