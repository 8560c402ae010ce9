"""Latency of live calls while a training run trains beside them, against the same calls with no run.

For each variant (``--variant 'NAME:KEY=VALUE;KEY=VALUE'``: settings and other environment variables of its
gateway, which its vLLM and training child inherit; by default one, ``shared``, with none), one real `kaizen
serve` (vLLM with the embedded model, SQLite, its own scheduler), one after the other:

1. a policy whose `train` section groups episodes by `metadata.group_key`, so a run's load is the update alone
   (no resampling), with collapse checks cut to one small one at the end;
2. ``--episodes`` rewarded calls: questions in groups of 8 by key, each rewarded 0 or 1 by a seeded draw through
   `POST /v1/feedback`, so every group has variance to learn from;
3. idle: ``--concurrency`` clients send calls for ``--seconds``; each latency is to the last byte;
4. training: the same run starts through the admin API (``--epochs`` passes over the data, so it lasts), and the
   same load runs while the run's status is `running`: from the child's start, through loading the model and
   the update, to its end.

On a GPU machine the variants name how serving and training share it (docs/operations.md): ``shared`` (one GPU,
vLLM's share of its memory set in ``KAIZEN_VLLM_EXTRA_ARGS``), ``apart`` (``KAIZEN_VLLM_REPLICA_GPUS=0;
KAIZEN_TRAIN_GPUS=1``) and ``asleep`` (``KAIZEN_ENGINE_SLEEP_DURING_TRAINING=true``, with vLLM's sleep mode). On
a CPU, `make bench-serving-during-training` runs ``default`` (vLLM's own binding, one training thread) beside
``cores`` (``KAIZEN_TRAIN_THREADS`` set to the number of cores: torch's default, a training thread per core) and
``split`` (``KAIZEN_VLLM_REPLICA_CPUS=0;KAIZEN_TRAIN_THREADS=1``: vLLM on the first core, one thread for training).

    python -m tests.bench.bench_serving_during_training [--seconds 30] [--concurrency 1] [--episodes 16] [--epochs 4]
        [--variant NAME:SETTINGS ...] [--out tests/bench/results/serving-during-training.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.bench.bench_overhead import percentile

log = logging.getLogger("bench_serving_during_training")

POLICY = "beside"
QUESTIONS = (
    "Name a colour.",
    "Give one word for happy.",
    "What is 2 + 2?",
    "Name a fruit.",
    "Say hello in French.",
    "Name an animal.",
    "What day comes after Monday?",
    "Name a planet.",
)
GROUP = 8


@dataclass
class Window:
    """The latencies (s) of the calls of one window, and what went wrong."""

    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        ordered = sorted(self.latencies)
        ms = [x * 1000 for x in ordered]
        return {
            "calls": len(ordered),
            "errors": len(self.errors),
            "error_examples": self.errors[:3],
            "seconds": round(self.seconds, 1),
            "p50_ms": round(percentile(ms, 50), 1) if ms else None,
            "p90_ms": round(percentile(ms, 90), 1) if ms else None,
            "p99_ms": round(percentile(ms, 99), 1) if ms else None,
            "mean_ms": round(statistics.fmean(ms), 1) if ms else None,
        }


def policy_config(epochs: int) -> dict[str, Any]:
    return {
        "train": {
            "grouping": "key",
            "group_size": GROUP,
            "min_group_size": 2,
            "epochs": epochs,
            "micro_batch_size": 8,
            "grad_accumulation": 1,
            "max_new_tokens": 16,
            "collapse_check_every": 0,
            "collapse_prompts": 1,
            "collapse_samples": 2,
            "collapse_max_new_tokens": 16,
        },
        "schedule": {"paused": True},  # the one run is the one this benchmark starts
    }


def chat_body(question: str, group_key: str | None = None) -> dict[str, Any]:
    """A timed call (greedy), or an episode of group `group_key` (sampled: the trainer learns nothing from the
    tokens every member of a group shares)."""
    body: dict[str, Any] = {
        "model": POLICY,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 16,
        "temperature": 0 if group_key is None else 1.0,
    }
    if group_key is not None:
        body["metadata"] = {"group_key": group_key}
    return body


async def rewarded_episodes(client: httpx.AsyncClient, count: int, seed: int) -> None:
    """`count` calls in groups of `GROUP` by key, each rewarded 0 or 1 (seeded) through the feedback API."""
    draw = random.Random(seed)
    for i in range(count):
        question = QUESTIONS[(i // GROUP) % len(QUESTIONS)]
        reply = await client.post("/v1/chat/completions", json=chat_body(question, f"g{i // GROUP}"))
        reply.raise_for_status()
        feedback = await client.post(
            "/v1/feedback", json={"request_id": reply.headers["x-request-id"], "value": draw.random() < 0.5}
        )
        feedback.raise_for_status()
        if (i + 1) % 16 == 0:
            log.info("rewarded episodes: %d of %d", i + 1, count)


async def load_while(client: httpx.AsyncClient, concurrency: int, going: asyncio.Event) -> Window:
    """Calls from `concurrency` clients, each sending the next when its last one ends, while `going` is set."""
    window = Window()
    started = time.monotonic()

    async def one_client(index: int) -> None:
        n = index
        while going.is_set():
            question = QUESTIONS[n % len(QUESTIONS)]
            n += concurrency
            began = time.perf_counter()
            try:
                reply = await client.post("/v1/chat/completions", json=chat_body(question))
            except httpx.HTTPError as exc:
                window.errors.append(repr(exc))
                continue
            if reply.status_code == 200:
                window.latencies.append(time.perf_counter() - began)
            else:
                window.errors.append(f"{reply.status_code} {reply.text[:200]}")

    await asyncio.gather(*(one_client(i) for i in range(concurrency)))
    window.seconds = time.monotonic() - started
    return window


async def idle_window(client: httpx.AsyncClient, concurrency: int, seconds: float) -> Window:
    going = asyncio.Event()
    going.set()
    loader = asyncio.create_task(load_while(client, concurrency, going))
    await asyncio.sleep(seconds)
    going.clear()
    return await loader


async def training_window(
    client: httpx.AsyncClient, admin: httpx.AsyncClient, concurrency: int, timeout_s: float
) -> tuple[Window, dict[str, Any]]:
    """The load while a training run is `running`, and the run as the admin API tells it at the end."""
    started = await admin.post(f"/admin/policies/{POLICY}/train")
    started.raise_for_status()
    run_id = started.json()["run_id"]
    going = asyncio.Event()
    going.set()
    loader = asyncio.create_task(load_while(client, concurrency, going))
    began = time.monotonic()
    run: dict[str, Any] = {}
    next_note = began + 15
    while time.monotonic() - began < timeout_s:
        run = (await admin.get(f"/admin/runs/{run_id}")).json()
        if run.get("status") != "running":
            break
        if time.monotonic() >= next_note:
            log.info("training run %d running for %.0f s", run_id, time.monotonic() - began)
            next_note += 15
        await asyncio.sleep(0.5)
    going.clear()
    window = await loader
    return window, {
        "id": run_id,
        "status": run.get("status"),
        "error": run.get("error"),
        "seconds": round(time.monotonic() - began, 1),
        "metrics": {k: v for k, v in (run.get("metrics") or {}).items() if isinstance(v, int | float)},
    }


async def run_variant(
    name: str, settings: dict[str, str], args: argparse.Namespace, work: Path
) -> dict[str, Any]:
    from gateway.base_models import resolve_base_model
    from gateway.commands.serve_process import GatewayProcess
    from gateway.demo.runner import wait_for_model
    from gateway.settings import Settings

    defaults = Settings()
    base = await asyncio.to_thread(resolve_base_model, defaults.base_model, defaults.data_dir / "models")
    data = work / name
    data.mkdir(parents=True)
    gateway = GatewayProcess(data, base, data / "gateway.log", settings)
    gateway.start()
    load_at_start = os.getloadavg()[0]
    try:
        await gateway.wait_ready()
        await gateway.create_policy(POLICY, policy_config(args.epochs))
        await wait_for_model(gateway.url, gateway.api_key, POLICY)
        headers = {"Authorization": f"Bearer {gateway.api_key}"}
        admin_headers = {"Authorization": f"Bearer {gateway.admin_key}"}
        async with (
            httpx.AsyncClient(base_url=gateway.url, headers=headers, timeout=300) as client,
            httpx.AsyncClient(base_url=gateway.url, headers=admin_headers, timeout=60) as admin,
        ):
            log.info("%s: %d rewarded episodes", name, args.episodes)
            await rewarded_episodes(client, args.episodes, args.seed)
            log.info("%s: idle load for %.0f s", name, args.seconds)
            idle = await idle_window(client, args.concurrency, args.seconds)
            log.info("%s: the same load while a training run trains", name)
            training, run = await training_window(client, admin, args.concurrency, args.run_timeout_s)
    finally:
        await asyncio.to_thread(gateway.stop)
    result: dict[str, Any] = {
        "variant": name,
        "settings": settings,
        "load_average_at_start": round(load_at_start, 2),
        "idle": idle.summary(),
        "training": training.summary(),
        "run": run,
    }
    if idle.latencies and training.latencies:
        result["p50_ratio"] = round(result["training"]["p50_ms"] / result["idle"]["p50_ms"], 2)
        result["p99_ratio"] = round(result["training"]["p99_ms"] / result["idle"]["p99_ms"], 2)
    log.info("%s: %s", name, json.dumps({k: result[k] for k in ("idle", "training", "run")}))
    return result


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """`NAME:KEY=VALUE;KEY=VALUE` (`;` between settings, so a value may hold commas: `KAIZEN_TRAIN_GPUS=1,2`)."""
    name, _, rest = text.partition(":")
    settings: dict[str, str] = {}
    for pair in filter(None, (p.strip() for p in rest.split(";"))):
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"variant {text!r}: {pair!r} is not NAME=VALUE")
        settings[key] = value
    if not name:
        raise argparse.ArgumentTypeError(f"variant {text!r} has no name")
    return name, settings


def format_table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | window | calls | errors | p50 ms | p90 ms | p99 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for result in results:
        for window in ("idle", "training"):
            s = result[window]
            lines.append(
                f"| {result['variant']} | {window} | {s['calls']} | {s['errors']} | {s['p50_ms']} | "
                f"{s['p90_ms']} | {s['p99_ms']} |"
            )
    return "\n".join(lines)


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    variants = [parse_variant(v) for v in args.variant] or [("shared", {})]
    with tempfile.TemporaryDirectory(prefix="kaizen-beside-") as tmp:
        results = [await run_variant(name, settings, args, Path(tmp)) for name, settings in variants]
    return {
        "method": (
            f"kaizen serve with vLLM and the embedded model per variant; {args.episodes} rewarded episodes in groups "
            f"of {GROUP} by key; {args.concurrency} client(s) sending 16-token chat calls back to back, "
            f"{args.seconds:.0f} s idle, then while one training run ({args.epochs} epochs, grouping key) is running"
        ),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "variants": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=30.0, help="length of the idle window")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument(
        "--epochs",
        type=int,
        default=4,
        help="passes of the run over its data: raise it on a GPU, where a run is short",
    )
    parser.add_argument("--run-timeout-s", type=float, default=1800.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variant", action="append", default=[], help="NAME:KAIZEN_X=V;OTHER=W (repeatable)")
    parser.add_argument("--out", type=Path, default=Path("tests/bench/results/serving-during-training.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per call otherwise
    result = asyncio.run(benchmark(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    log.info("results written to %s\n%s", args.out, format_table(result["variants"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
