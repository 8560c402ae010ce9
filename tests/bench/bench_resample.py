"""Resampling through the serving engine: one trajectory at a time against `resample_concurrency` at once.

A real `kaizen serve` with vLLM (CPU build, embedded model) serves a fresh policy; `trainer.learner.grouping
.resample_groups` resamples the same trajectories (k-1 replies each, temperature 1, `max_new_tokens` cap)
through `trainer.learner.engine_sampling.EngineSampler` exactly as `kaizen train` does, with a scorer that answers at
once so only sampling is timed. Concurrency 1 and the configured concurrency alternate, so drift hits both.

    python -m tests.bench.bench_resample [--concurrency 8] [--rounds 2] [--out tests/bench/results/resample.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("bench_resample")

POLICY = "bench"
QUESTIONS = [
    "Name a colour.",
    "What is two plus two?",
    "Give me a word that rhymes with cat.",
    "What is the capital of Italy?",
    "Name an animal that can fly.",
    "What do bees make?",
    "Name a planet.",
    "What is the opposite of hot?",
    "Name a fruit that is yellow.",
    "How many legs does a spider have?",
    "What colour is grass?",
    "Name a musical instrument.",
    "What is frozen water called?",
    "Name a day of the week.",
    "What do cows drink?",
    "Name a shape with three sides.",
]


class InstantScorer:
    """Scores every reply 0 without waiting: the benchmark times sampling only."""

    async def score(
        self, conversations: list[list[dict[str, Any]]], original: list[dict[str, Any]]
    ) -> list[float | None]:
        return [0.0] * len(conversations)


async def resample_once(
    url: str, api_key: str, tokenizer: Any, concurrency: int, args: argparse.Namespace
) -> dict[str, float]:
    from trainer.control.policy_config import TrainConfig
    from trainer.learner.dataset import DataReport, TrainingExample
    from trainer.learner.engine_sampling import EngineEndpoint
    from trainer.learner.grouping import resample_groups

    trajectories = [
        TrainingExample(
            episode_id=f"e{i}",
            context=[{"role": "user", "content": question}],
            tools=None,
            reply={"role": "assistant", "content": "?"},
            reward=0.0,
            prompt_token_ids=None,
            completion_token_ids=None,
            completion_logprobs=None,
        )
        for i, question in enumerate(QUESTIONS[: args.trajectories])
    ]
    # One round: every group scores 0, and extra rounds for groups without reward variance are not timed here.
    cfg = TrainConfig(
        group_size=args.group_size,
        max_new_tokens=args.max_new_tokens,
        resample_concurrency=concurrency,
        resample_max_group_size=args.group_size,
    )
    sampler = EngineEndpoint(f"{url}/v1", api_key).sampler(
        POLICY, tokenizer, max_tokens=cfg.max_new_tokens, temperature=cfg.temperature
    )
    report = DataReport()
    started = time.perf_counter()
    await resample_groups(trajectories, cfg, sampler, InstantScorer(), report)
    seconds = time.perf_counter() - started
    # Every group scores 0 throughout, so none is kept: the replies are counted from the report instead.
    replies = report.as_dict().get("resampled_replies", 0)
    return {"seconds": seconds, "replies": replies, "replies_per_s": replies / seconds}


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from gateway.base_models import resolve_base_model
    from gateway.commands.serve_process import GatewayProcess

    base_path = await asyncio.to_thread(resolve_base_model, "smollm2-135m-instruct", args.models_dir)
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    with tempfile.TemporaryDirectory(prefix="kaizen-bench-resample-") as tmp:
        data_dir = Path(tmp)
        gateway = GatewayProcess(data_dir, base_path, data_dir / "gateway.log")
        url, api_key = gateway.url, gateway.api_key
        gateway.start()
        try:
            await gateway.wait_ready()
            await gateway.create_policy(POLICY)
            # Warm-up: the first requests load the policy's adapter into vLLM.
            await resample_once(url, api_key, tokenizer, args.concurrency, args)
            runs: dict[str, list[dict[str, float]]] = {"sequential": [], "concurrent": []}
            for round_index in range(args.rounds):
                for side, concurrency in (("sequential", 1), ("concurrent", args.concurrency)):
                    result = await resample_once(url, api_key, tokenizer, concurrency, args)
                    runs[side].append(result)
                    logger.info(
                        "round %d %-10s %5.1f s  %5.2f replies/s",
                        round_index,
                        side,
                        result["seconds"],
                        result["replies_per_s"],
                    )
        finally:
            gateway.stop()
    best = {side: max(results, key=lambda r: r["replies_per_s"]) for side, results in runs.items()}
    return {
        "method": (
            "trainer.learner.grouping.resample_groups through a real kaizen serve + vLLM (CPU build), EngineSampler as in "
            "kaizen train; instant scorer; concurrency 1 and N alternating; best round per side"
        ),
        "trajectories": args.trajectories,
        "group_size": args.group_size,
        "max_new_tokens": args.max_new_tokens,
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "runs": runs,
        "sequential_replies_per_s": best["sequential"]["replies_per_s"],
        "concurrent_replies_per_s": best["concurrent"]["replies_per_s"],
        "speedup": best["concurrent"]["replies_per_s"] / best["sequential"]["replies_per_s"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models-dir", type=Path, default=Path("kaizen-data/models"))
    parser.add_argument("--trajectories", type=int, default=16, choices=range(1, len(QUESTIONS) + 1))
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("tests/bench/results/resample.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the progress output
    summary = asyncio.run(benchmark(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    sys.stdout.write(
        f"| | one at a time | {args.concurrency} at once | ratio |\n|---|---|---|---|\n"
        f"| resampled replies/s | {summary['sequential_replies_per_s']:.2f} | "
        f"{summary['concurrent_replies_per_s']:.2f} | {summary['speedup']:.2f}× |\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
