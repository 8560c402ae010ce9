"""Canary rollouts on the embedded model: a worse candidate is rolled back, a no-worse one promoted, on live traffic.

One real gateway (in-process, `KAIZEN_ENGINE=vllm`: CPU vLLM with the embedded model) runs the scheduler, so
the canary monitor looks at the running rollout every `--check-s` seconds. The policy scores replies with
`tests.support.gate_rewards:brevity` (1 - tokens / 32: the base model's short answers score in the middle, so
both "worse" and "no worse" show within a few dozen episodes), gates candidates leniently (any reward drop,
any collapse passes) and puts a candidate that passes on a canary of `--share` of the calls.

The app is a thread pool asking short questions, each call with its own `user` (so the share is drawn per
call), scoring each reply with the same `brevity` and sending it as feedback (`POST /v1/feedback`), as an app
that rates its replies would.

1. Warm-up: `--warmup` rewarded calls on version 0 (the base reward, and the held-out material the gate samples).
2. `worse`: version 1 is version 0 trained on purpose against the reward: GRPO on 1 - brevity (`--bad
   inverted`, a few updates in-process, `tests.support.reward_hacking.train_once`), so it rambles to the
   length cap; or version 0 with random large lora_B weights (`--bad scaled`), replies in garbage. The gate
   passes it and `ship` starts a canary; traffic runs until the monitor decides (expected: rolled back).
3. `no-worse`: version 2 is a copy of version 0's weights; gate, canary, traffic until the decision
   (expected: promoted).

For each scenario the results keep the decision and its reason (which rule: health or reward), the calls from
the canary's start to the decision (all, on the candidate, on the baseline), the rewarded episodes per arm the
decision saw, the minutes to the decision, and the rule it ran under.

    python -m tests.bench.bench_canary [--share 0.3] [--check-s 5] [--bad inverted|scaled]
        [--out tests/bench/results/canary.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import func, select

from gateway.base_models import resolve_base_model
from gateway.settings import Settings
from storage.database import Database
from storage.models import Call
from storage.policies import PolicyInfo, adapter_dir
from storage.rollouts import RolloutInfo, list_rollouts
from tests.conftest import MODELS_DIR, VLLM_ADMIN_KEY, VLLMServer
from tests.integration.test_gate import add_version, finished_run, make_policy, register_version, run
from tests.support.gate_rewards import brevity
from tests.support.gateway_server import GatewayServer
from tests.support.ports import free_port
from tests.support.reward_hacking import train_once

logger = logging.getLogger("bench_canary")

POLICY = "canary"
MODEL = "smollm2-135m-instruct"
#: Short questions, asked as an app that wants short answers would: the base model answers most in a few words,
#: some at length, so its `brevity` sits in the middle of [0, 1] with room to fall.
INSTRUCTION = " Answer in a few words."
QUESTIONS = [
    question + INSTRUCTION
    for question in (
        "What is the capital of France?",
        "How many legs does a spider have?",
        "Name a fruit.",
        "What do bees make?",
        "What colour is grass?",
        "Name a planet.",
        "What is the opposite of hot?",
        "What is frozen water called?",
        "Name a musical instrument.",
        "What is two plus two?",
        "Name an animal that can fly.",
        "What do cows drink?",
    )
]
#: Questions the inverted candidate is trained on (a subset: it generalises to the rest).
TRAIN_QUESTIONS = QUESTIONS[:4]
#: A gate that any candidate that still answers passes: the canary, not the gate, has to catch it.
LOOSE_BOUNDS = {
    "min_distinct_ratio": 0.0,
    "min_distinct_share": 0.0,
    "max_empty_share": 1.0,
    "max_repetition": 1.0,
    "min_length_ratio": 0.0,
    "min_entropy_ratio": 0.0,
    "max_kl_to_start": 1000.0,
}


def policy_config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "rewards": {"scorer": {"function": "tests.support.gate_rewards:brevity"}},
        "gate": {
            "tolerance": 1.0,
            "collapse_bounds": LOOSE_BOUNDS,
            "max_groups": 2,
            "samples": 2,
            "max_tokens": args.max_tokens,
        },
        "rollout": rule(args),
        "schedule": {"paused": True},  # no scheduled training or judging: only the monitor runs
    }


def rule(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "canary_share": args.share,
        "alpha": args.alpha,
        "margin": args.margin,
        "tau": args.tau,
        "min_episodes": args.min_episodes,
        "min_calls": args.min_episodes,
    }


class App:
    """The simulated app: concurrent calls, each by its own user, each reply scored and the score sent back."""

    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.url = url
        self.args = args
        self.counter = itertools.count()
        self.lock = threading.Lock()
        self.calls = 0
        self.failures = 0
        self.rewards: list[float] = []
        # Loads the reward's tokenizer once, here: threads importing transformers at once can see it half-imported.
        brevity({"messages": [{"role": "assistant", "content": ""}]})

    def one(self, client: httpx.Client, scenario: str) -> None:
        index = next(self.counter)
        question = QUESTIONS[index % len(QUESTIONS)]
        messages = [{"role": "user", "content": question}]
        try:
            reply = client.post(
                self.url + "/v1/chat/completions",
                json={
                    "model": POLICY,
                    "messages": messages,
                    "max_tokens": self.args.max_tokens,
                    "temperature": self.args.temperature,
                    "user": f"{scenario}-{index}",
                },
            )
            reply.raise_for_status()
            content = reply.json()["choices"][0]["message"].get("content") or ""
            value = brevity({"messages": [*messages, {"role": "assistant", "content": content}]})
            client.post(
                self.url + "/v1/feedback",
                json={"request_id": reply.headers["x-request-id"], "value": value},
            ).raise_for_status()
        except httpx.HTTPError as exc:
            logger.warning("call %d failed: %r", index, exc)
            with self.lock:
                self.failures += 1
            return
        with self.lock:
            self.calls += 1
            self.rewards.append(value)

    def drive(self, scenario: str, done: Callable[[], bool], max_calls: int, max_s: float) -> None:
        """Calls from `--concurrency` threads until `done()` is true, or `max_calls` were sent or `max_s` passed."""
        stop = threading.Event()
        start_calls = self.calls

        def worker() -> None:
            with httpx.Client(timeout=120) as client:
                while not stop.is_set() and self.calls - start_calls < max_calls:
                    self.one(client, scenario)

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(self.args.concurrency)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + max_s
        last_log = time.monotonic()
        try:
            while any(t.is_alive() for t in threads) and time.monotonic() < deadline and not done():
                time.sleep(1.0)
                if time.monotonic() - last_log >= 15:
                    last_log = time.monotonic()
                    logger.info("  %s: %d calls so far", scenario, self.calls - start_calls)
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=180)


def start_server(data_dir: Path, args: argparse.Namespace) -> VLLMServer:
    (data_dir / "models").symlink_to(MODELS_DIR)
    port = free_port()
    settings = Settings.load(
        data_dir=data_dir,
        database_url=f"sqlite:///{data_dir / 'kaizen.db'}",
        engine="vllm",
        vllm_port=port,
        port=0,
        capture_flush_ms=5.0,
        policy_refresh_s=0.5,
        scheduler=True,
        scheduler_refresh_s=5.0,
        rollout_check_s=args.check_s,
        admin_key=VLLM_ADMIN_KEY,
    )
    gateway = GatewayServer(settings, startup_timeout_s=900).start()
    return VLLMServer(gateway, f"http://127.0.0.1:{port}/v1", MODEL)


def latest_rollout(server: VLLMServer) -> RolloutInfo | None:
    async def read(database: Database) -> RolloutInfo | None:
        async with database.session() as session:
            rollouts = await list_rollouts(session, POLICY, limit=1)
        return rollouts[0] if rollouts else None

    return run(server, read)  # type: ignore[no-any-return]


def served(server: VLLMServer, since: datetime, until: datetime) -> dict[int | None, int]:
    """Calls to the policy per version that served them, between the canary's start and its decision."""

    async def count(database: Database) -> dict[int | None, int]:
        async with database.session() as session:
            rows = await session.execute(
                select(Call.adapter_version, func.count())
                .where(Call.policy == POLICY, Call.created_at >= since, Call.created_at <= until)
                .group_by(Call.adapter_version)
            )
        return {version: int(n) for version, n in rows}

    return run(server, count)  # type: ignore[no-any-return]


def inverted_candidate(server: VLLMServer, target: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Version 0 trained with GRPO against the reward (1 - brevity): it learns to run to the length cap."""
    started = time.monotonic()
    trained = train_once(
        resolve_base_model(MODEL, server.data_dir / "models"),
        adapter_dir(server.data_dir, POLICY, 0),
        target,
        lambda trajectory: 1.0 - brevity(trajectory),
        TRAIN_QUESTIONS,
        max_rounds=args.train_rounds,
        max_new_tokens=args.max_tokens,
        min_empty_share=2.0,  # never stops early: the rounds are the budget
    )
    rounds = [round(1.0 - r.reward, 3) for r in trained.rounds]
    logger.info(
        "inverted training: %d updates in %.0f s, brevity per round %s",
        trained.updates,
        time.monotonic() - started,
        rounds,
    )
    return {"updates": trained.updates, "seconds": time.monotonic() - started, "brevity_per_round": rounds}


def scenario(
    server: VLLMServer, app: App, policy: PolicyInfo, name: str, version: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Gate the candidate `version`, then traffic until its canary is decided; what it took."""
    run_id = finished_run(server, policy, version)
    jobs = server.gateway.services.jobs
    gate = server.gateway.call(jobs.runner.gate(POLICY, run_id), timeout_s=900)
    logger.info(
        "%s: gate %s (candidate %s, active %s)",
        name,
        gate.decision,
        gate.candidate_reward,
        gate.active_reward,
    )
    result: dict[str, Any] = {
        "version": version,
        "gate": {
            "decision": gate.decision,
            "candidate_reward": gate.candidate_reward,
            "active_reward": gate.active_reward,
        },
    }
    rollout = latest_rollout(server)
    if rollout is None or rollout.version != version or rollout.status != "running":
        logger.warning("%s: no canary started", name)
        return {**result, "decision": "no canary"}
    logger.info(
        "%s: canary %d of version %d on %.0f%% of calls", name, rollout.id, version, rollout.share * 100
    )
    first_reward = len(app.rewards)
    sent_before = app.calls
    clock = time.monotonic()

    def decided() -> bool:
        current = latest_rollout(server)
        return current is not None and current.id == rollout.id and current.status != "running"

    app.drive(name, decided, args.max_calls, args.max_minutes * 60)
    wall_s = time.monotonic() - clock
    ended = latest_rollout(server)
    assert ended is not None
    stats = ended.stats or {}
    arms = {arm: stats.get(arm) or {} for arm in ("candidate", "baseline")}
    until = ended.decided_at or datetime.now(UTC)
    counts = served(server, rollout.started_at, until)
    decision_s = (until - rollout.started_at).total_seconds() if ended.decided_at else None
    sent = app.rewards[first_reward:]
    logger.info("%s: %s after %s s: %s", name, ended.status, decision_s and round(decision_s), ended.reason)
    return {
        **result,
        "decision": ended.status,
        "reason": ended.reason,
        # which of the monitor's rules decided (none: still undecided at --max-calls or --max-minutes)
        "rule": None
        if ended.running
        else "health"
        if (ended.reason or "").startswith("health")
        else "reward",
        "calls_to_decision": sum(counts.values()),
        "candidate_calls": counts.get(version, 0),
        "baseline_calls": sum(n for v, n in counts.items() if v != version),
        "rewarded_episodes": {arm: arms[arm].get("rewarded") for arm in arms},
        "mean_reward": {arm: arms[arm].get("mean") for arm in arms},
        # each arm's mean reward with its 95% interval, as the monitor's last look saw it
        "arms": {
            arm: {key: arms[arm].get(key) for key in ("version", "mean", "low", "high")} for arm in arms
        },
        "difference": stats.get("difference"),
        "minutes_to_decision": decision_s / 60 if decision_s is not None else None,
        "calls_sent_by_the_app": app.calls - sent_before,
        "wall_minutes_of_traffic": wall_s / 60,
        "app_mean_reward": sum(sent) / len(sent) if sent else None,
    }


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="kaizen-bench-canary-") as tmp:
        server = start_server(Path(tmp), args)
        try:
            logger.info("gateway and vLLM up after %.0f s", time.monotonic() - started)
            policy = make_policy(server, POLICY, policy_config(args))
            app = App(server.gateway.url, args)
            app.drive("warmup", lambda: False, args.warmup, 600)
            base_reward = sum(app.rewards) / len(app.rewards)
            logger.info("warm-up: %d calls on version 0, mean brevity %.3f", app.calls, base_reward)
            if args.bad == "inverted":
                target = adapter_dir(server.data_dir, POLICY, 1)
                making = inverted_candidate(server, target, args)
                register_version(server, policy, 1, target)
            else:
                add_version(server, policy, 1, lora_b_scale=args.lora_b_scale)
                making = {"lora_b_scale": args.lora_b_scale}
            worse = {"made_by": args.bad, **making, **scenario(server, app, policy, "worse", 1, args)}
            add_version(server, policy, 2)  # version 0's weights
            same = {"made_by": "copy of version 0", **scenario(server, app, policy, "no-worse", 2, args)}
            failures = app.failures
        finally:
            server.gateway.stop()
    return {
        "method": (
            "in-process gateway with the scheduler (canary monitor every check_s) in front of CPU vLLM, embedded "
            "model; app threads, one user per call, brevity reward as feedback; lenient gate, then canary"
        ),
        "rule": {**rule(args), "check_s": args.check_s},
        "traffic": {
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "warmup_calls": args.warmup,
            "base_mean_reward": base_reward,
            "failed_calls": failures,
        },
        "scenarios": {"worse": worse, "no_worse": same},
        "machine": {
            "cpus": os.cpu_count(),
            "cpu": platform.processor() or platform.machine(),
            "engine": "vLLM CPU build",
            "load_average_at_start": load_at_start,
            "load_average_at_end": os.getloadavg()[0],
        },
        "total_minutes": (time.monotonic() - started) / 60,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--share", type=float, default=0.3)
    parser.add_argument("--alpha", type=float, default=0.05)
    parser.add_argument("--margin", type=float, default=0.1)
    parser.add_argument("--tau", type=float, default=0.1)
    parser.add_argument("--min-episodes", type=int, default=20)
    parser.add_argument("--check-s", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--warmup", type=int, default=24)
    parser.add_argument("--bad", choices=("inverted", "scaled"), default="inverted")
    parser.add_argument("--train-rounds", type=int, default=4)
    parser.add_argument("--lora-b-scale", type=float, default=5.0)
    parser.add_argument("--max-calls", type=int, default=1500, help="per scenario, undecided beyond")
    parser.add_argument("--max-minutes", type=float, default=8.0, help="per scenario, undecided beyond")
    parser.add_argument("--out", type=Path, default=Path("tests/bench/results/canary.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    for chatty in ("httpx", "httpx2"):  # a line per request drowns the progress lines
        logging.getLogger(chatty).setLevel(logging.WARNING)
    summary = benchmark(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    lines = [
        "| candidate | decision | rule | calls (candidate) | rewarded episodes c/b | minutes |",
        "|---|---|---|---|---|---|",
    ]
    for key, found in summary["scenarios"].items():
        episodes = found.get("rewarded_episodes") or {}
        minutes = found.get("minutes_to_decision")
        lines.append(
            f"| {key} | {found['decision']} | {found.get('rule')} | {found.get('calls_to_decision')} "
            f"({found.get('candidate_calls')}) | {episodes.get('candidate')}/{episodes.get('baseline')} | "
            f"{'-' if minutes is None else f'{minutes:.1f}'} |"
        )
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
