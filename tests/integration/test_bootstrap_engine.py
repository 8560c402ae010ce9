"""`kaizen bootstrap` on the real vLLM engine: a policy nobody has sent traffic to is trained on scenarios a model
wrote for its task, and its first trained version beats the base model on scenarios it never trained on.

The scenario writer is the scripted judge (the scenarios are the point of `test_scenarios.py`, not here); the
attempts, the training run (the gateway's training child), the evaluation gate and the promotion are the real
ones. The task rewards a reply of exactly one word, which the embedded model rarely gives at first: rewards are
sparse, so `--mode auto` starts with SFT on the successes before GRPO.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import VLLM_ADMIN_KEY, VLLMServer, query
from tests.integration.test_gate import make_policy
from tests.integration.test_train_sft import sft_settings
from tests.support.improvement import assert_improved
from tests.support.scripted_judge import ScriptedJudge

# Attempts, a training child, the gate's samples and a promotion on the shared CPU vLLM: 330 s on a slow 2-core
# machine, past pytest's default 300 s. The run's own timeout comes first, with its output.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[2]
POLICY = "cold-start"
TASK = "Answer every question with exactly one word."
SCENARIOS = [
    f"{question} Reply with one word only."
    for question in (
        "Name a color.",
        "Name an animal.",
        "What is the capital of France?",
        "Name a fruit.",
        "Name a planet.",
        "Name a country.",
        "Name a flower.",
        "Name a metal.",
        "Name a musical instrument.",
        "Name a season.",
        "Name a vegetable.",
        "Name an ocean.",
    )
]
EVAL = 3
# The attempts are seeded too, so the run trains on the same replies every time (training is seeded by
# `train.seed`, the gate by `gate.seed`): its outcome no longer depends on which replies one sampling happened to
# draw, as when an unseeded run's candidate once tied the base model.
SEED = 11
GATE_SAMPLES = 8
CONFIG = {
    "rewards": {"scorer": {"function": "tests.support.reward_functions:one_word"}},
    # The SFT test's settings for this task (its mode and grouping are the bootstrap run's own choice), with four
    # passes over the groups: with one, a run whose attempts had signal enough for GRPO alone made 3 updates and
    # barely moved (KL 0.017 nats/token; held-out reward about 0.23 against the base model's 0.09, each sampled
    # some 150 times), where four passes on the same attempts reach 0.56.
    "train": {**sft_settings(), "learning_rate": 2e-4, "loss_mode": "cispo", "epochs": 4},
    # 8 replies per held-out scenario from each version, 24 in all: with 4 (12 in all) one reply was worth 0.083
    # of reward, and that barely trained candidate tied the base model at 0.083. Both versions answer a scenario
    # with one seed: the comparison is paired on the same draws, and the base model's replies, so its score, are
    # the same in every run.
    "gate": {
        "samples": GATE_SAMPLES,
        "seed": 7,
        "max_tokens": 32,
        "collapse_bounds": {"min_length_ratio": 0.0},
    },
}


def test_bootstrap_trains_a_policy_without_traffic_that_beats_its_base(
    vllm_server: VLLMServer, tmp_path: Path
) -> None:
    make_policy(vllm_server, POLICY, CONFIG)
    database_url = vllm_server.gateway.settings.database_url
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAIZEN_")}
    with ScriptedJudge() as writer:
        for batch in (SCENARIOS[:8], SCENARIOS[8:]):  # the writer is asked for 8 at a time
            writer.script.append(json.dumps({"scenarios": [{"message": m} for m in batch]}))
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "gateway",
                "bootstrap",
                f"--policy={POLICY}",
                f"--task={TASK}",
                f"--scenarios={len(SCENARIOS)}",
                "--attempts=4",
                f"--eval-scenarios={EVAL}",
                "--max-tokens=32",
                f"--seed={SEED}",
                f"--gateway-url={vllm_server.gateway.url}/v1",
                "--writer-model=writer-model",
                f"--writer-api-base={writer.url}",
                f"--data-dir={tmp_path}",
            ],
            env={**env, "KAIZEN_ADMIN_KEY": VLLM_ADMIN_KEY},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=1080,
            check=False,
        )
    report = json.loads(done.stdout)
    print(json.dumps(report, indent=2))
    assert report["train_status"] in ("succeeded", "rejected"), done.stderr[-4000:]
    assert (report["scenarios"], report["eval_scenarios"], report["episodes"]) == (12, EVAL, 48)
    assert report["mode"] in ("warm_start", "grpo")

    # The attempts are episodes of source `bootstrap`, grouped per scenario, scored by the policy's scorer.
    episodes = query(database_url, "SELECT source, group_key FROM episodes WHERE policy = :p", p=POLICY)
    assert len(episodes) == 48 and {e["source"] for e in episodes} == {"bootstrap"}
    assert len({e["group_key"] for e in episodes}) == len(SCENARIOS)
    [run] = query(
        database_url, "SELECT config, metrics FROM training_runs WHERE id = :id", id=report["train_run"]
    )
    config = json.loads(run["config"]) if isinstance(run["config"], str) else run["config"]
    metrics = json.loads(run["metrics"]) if isinstance(run["metrics"], str) else run["metrics"]
    assert (config["mode"], config["grouping"], config["group_size"]) == (report["mode"], "key", 4)
    assert metrics["data"]["held_out_for_gate"] == EVAL * 4  # the gate's scenarios were never trained on

    # Better than the base before the first user arrives: the gate compared both on the held-out scenarios, and
    # the candidate's gain is more than its 24 replies a side can explain by chance (0.433; measured: 0.75-0.96
    # against the base model's 0.125 on this machine).
    gate = report["gate"]
    print(f"held-out reward: candidate {gate['candidate_reward']:.3f}, base {gate['active_reward']:.3f}")
    assert gate["groups"] == EVAL
    assert gate["decision"] == "promote", gate
    assert_improved(gate["active_reward"], EVAL * GATE_SAMPLES, gate["candidate_reward"], EVAL * GATE_SAMPLES)
    assert done.returncode == 0
    [policy] = query(database_url, "SELECT active_version FROM policies WHERE name = :p", p=POLICY)
    assert policy["active_version"] == report["version"] == 1
