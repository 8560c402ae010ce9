"""What serving through vLLM costs on this machine: start-up, generation throughput (base vs LoRA), adapter loads.

vLLM is started exactly as the gateway starts it (``build_vllm_engine`` from the settings, on a free port),
and every request goes through the engine's own client, so the numbers are what the gateway sees. Generation
is greedy with ``ignore_eos`` and a fixed ``max_tokens``, so every request produces the same number of tokens
whatever the model says; base and LoRA rounds alternate so drift (other load on the machine) hits both alike.
The LoRA is the gateway's own version-0 adapter (``write_initial_adapter``) with random non-zero ``lora_B``,
so vLLM really applies it. Hot reload under load (``--hot-streams``): that many streams keep generating through
the LoRA while new adapter versions are loaded one every ``--hot-interval-s``, the way a promotion loads the
candidate while traffic is served; it reports each load, the first request on each new version, and the
streams' throughput and request times in a window without loads against one of the same length with them.

    python -m tests.bench.bench_engine [--out tests/bench/results/engine.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.app import build_vllm_engine
from gateway.base_models import resolve_base_model
from gateway.engines.vllm import VLLMEngine
from gateway.settings import Settings
from tests.support.ports import free_port
from trainer.control.policy_config import TrainConfig
from trainer.learner.initial_adapter import write_initial_adapter

logger = logging.getLogger("bench_engine")

DEFAULT_OUT = Path(__file__).parent / "results" / "engine.json"
ADAPTER_PREFIX = "bench"


def randomise_lora_b(adapter: Path, seed: int, std: float) -> None:
    """PEFT starts B at zero (the adapter is then the base model); random B makes vLLM do real LoRA work."""
    import torch
    from safetensors.torch import load_file, save_file

    weights_file = adapter / "adapter_model.safetensors"
    tensors = load_file(weights_file)
    generator = torch.Generator().manual_seed(seed)
    changed = 0
    for key, tensor in tensors.items():
        if "lora_B" in key:
            noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32) * std
            tensors[key] = noise.to(tensor.dtype)
            changed += 1
    if not changed:
        raise RuntimeError(f"no lora_B weights in {weights_file}")
    save_file(tensors, weights_file, metadata={"format": "pt"})


def make_adapters(base_path: str, root: Path, count: int, rank: int) -> list[Path]:
    """One adapter built the gateway's way, then copied: each load below reads its own directory."""
    first = root / "0"
    started = time.perf_counter()
    write_initial_adapter(base_path, first, TrainConfig(lora_rank=rank, lora_alpha=2 * rank))
    randomise_lora_b(first, seed=0, std=0.02)
    logger.info("built a rank-%d adapter in %.1f s", rank, time.perf_counter() - started)
    copies = [first]
    for index in range(1, count):
        copies.append(Path(shutil.copytree(first, root / str(index))))
    return copies


@dataclass(frozen=True)
class Batch:
    """Requests sent at once and what came back in total."""

    streams: int
    tokens: int
    seconds: float

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.seconds


def chat_body(model: str, index: int, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": f"Tell me a long story, number {index}."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,  # vLLM extension: exactly max_tokens tokens, whatever the model says
    }


async def generate(engine: VLLMEngine, model: str, streams: int, max_tokens: int) -> Batch:
    """``streams`` concurrent requests; fails unless each produced exactly ``max_tokens`` tokens."""

    async def one(index: int) -> int:
        response = await engine.chat(chat_body(model, index, max_tokens))
        produced = int(response["usage"]["completion_tokens"])
        if produced != max_tokens:
            raise RuntimeError(f"{model}: {produced} tokens generated, expected {max_tokens}")
        return produced

    started = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(index) for index in range(streams))))
    return Batch(streams, tokens, time.perf_counter() - started)


async def one_token_latency(engine: VLLMEngine, model: str) -> float:
    started = time.perf_counter()
    await generate(engine, model, 1, 1)
    return time.perf_counter() - started


async def measure_throughput(
    engine: VLLMEngine, models: dict[str, str], args: argparse.Namespace
) -> dict[str, dict[str, list[float]]]:
    """tok/s per side and stream count, one value per round; the sides swap order every round."""
    per_round: dict[str, dict[str, list[float]]] = {
        side: {str(streams): [] for streams in args.streams} for side in models
    }
    sides = list(models)
    for round_no in range(args.rounds):
        order = sides if round_no % 2 == 0 else sides[::-1]
        for side in order:
            for streams in args.streams:
                batch = await generate(engine, models[side], streams, args.max_tokens)
                per_round[side][str(streams)].append(batch.tok_per_s)
                logger.info(
                    "round %d/%d %s, %d stream(s): %d tokens in %.2f s = %.1f tok/s",
                    round_no + 1,
                    args.rounds,
                    side,
                    streams,
                    batch.tokens,
                    batch.seconds,
                    batch.tok_per_s,
                )
    return per_round


async def measure_adapter_loads(
    engine: VLLMEngine, adapters: Sequence[Path], base_model: str, repeats: int
) -> dict[str, Any]:
    """Load time of new adapter names, and what the first request on each costs against the base model."""
    base = [await one_token_latency(engine, base_model) for _ in range(repeats)]
    loads, first, second = [], [], []
    for index, path in enumerate(adapters, start=1):
        name = f"{ADAPTER_PREFIX}@{index}"
        started = time.perf_counter()
        await engine.load_adapter(name, str(path))
        loads.append(time.perf_counter() - started)
        first.append(await one_token_latency(engine, name))
        second.append(await one_token_latency(engine, name))
        logger.info(
            "%s: load %.3f s, first 1-token request %.3f s, second %.3f s",
            name,
            loads[-1],
            first[-1],
            second[-1],
        )
    return {
        "load_s": loads,
        "load_mean_s": statistics.fmean(loads),
        "load_max_s": max(loads),
        "base_one_token_s": base,
        "base_one_token_median_s": statistics.median(base),
        "fresh_adapter_first_one_token_s": first,
        "fresh_adapter_first_one_token_mean_s": statistics.fmean(first),
        "fresh_adapter_second_one_token_s": second,
        "fresh_adapter_second_one_token_mean_s": statistics.fmean(second),
        "first_request_ratio": statistics.fmean(first) / statistics.median(base),
    }


@dataclass(frozen=True)
class Finished:
    """One request of the background streams: when it ended, how long it took, what it produced."""

    ended: float
    seconds: float
    tokens: int
    error: str | None


def window_stats(requests: Sequence[Finished], start: float, end: float) -> dict[str, Any]:
    """Throughput in [start, end) and the times of the requests that ended in it.

    Each request's tokens count in proportion to the share of its run inside the window: streams that start
    together finish in waves, and counting whole requests by their end would measure the waves, not the rate."""
    tokens = 0.0
    for r in requests:
        if r.error is None and r.seconds > 0:
            overlap = min(end, r.ended) - max(start, r.ended - r.seconds)
            tokens += r.tokens * max(0.0, overlap) / r.seconds
    inside = [r for r in requests if start <= r.ended < end]
    times = sorted(r.seconds for r in inside if r.error is None)
    return {
        "seconds": end - start,
        "requests": len(inside),
        "errors": sum(r.error is not None for r in inside),
        "tok_s": tokens / (end - start),
        "request_median_s": statistics.median(times) if times else None,
        "request_max_s": times[-1] if times else None,
    }


async def measure_hot_reload(
    engine: VLLMEngine, serving: str, adapters: Sequence[Path], args: argparse.Namespace
) -> dict[str, Any]:
    """Load new adapter versions while `args.hot_streams` streams generate through `serving`.

    The window without loads comes first and lasts as long as the loads do, so both see the same warm engine."""
    finished: list[Finished] = []
    stop = asyncio.Event()
    warm = asyncio.Event()  # every stream has finished one request before either window opens

    async def stream(worker: int) -> None:
        index = 0
        while not stop.is_set():
            started = time.perf_counter()
            error: str | None = None
            tokens = 0
            try:
                response = await engine.chat(chat_body(serving, worker * 10_000 + index, args.max_tokens))
                tokens = int(response["usage"]["completion_tokens"])
            except Exception as exc:  # counted: a load must not fail a request in flight
                error = repr(exc)
            now = time.perf_counter()
            finished.append(Finished(now, now - started, tokens, error))
            if len(finished) >= args.hot_streams:
                warm.set()
            index += 1

    workers = [asyncio.create_task(stream(worker)) for worker in range(args.hot_streams)]
    loads, first = [], []
    try:
        await warm.wait()
        window = args.hot_interval_s * len(adapters)
        quiet_start = time.perf_counter()
        await asyncio.sleep(window)
        loads_start = time.perf_counter()
        for index, path in enumerate(adapters, start=1):
            due = loads_start + (index - 1) * args.hot_interval_s
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            name = f"{ADAPTER_PREFIX}-hot@{index}"
            started = time.perf_counter()
            await engine.load_adapter(name, str(path))
            loads.append(time.perf_counter() - started)
            first.append(await one_token_latency(engine, name))
            logger.info(
                "under load: %s loaded in %.3f s, its first 1-token request %.3f s",
                name,
                loads[-1],
                first[-1],
            )
        await asyncio.sleep(max(0.0, loads_start + window - time.perf_counter()))
        loads_end = time.perf_counter()
    finally:
        stop.set()
        await asyncio.gather(*workers)
    quiet = window_stats(finished, quiet_start, loads_start)
    loaded = window_stats(finished, loads_start, loads_end)
    errors = [r.error for r in finished if r.error is not None]
    logger.info(
        "hot reload under %d streams: %.1f tok/s without loads, %.1f with; %d request error(s)",
        args.hot_streams,
        quiet["tok_s"],
        loaded["tok_s"],
        len(errors),
    )
    return {
        "streams": args.hot_streams,
        "interval_s": args.hot_interval_s,
        "load_s": loads,
        "load_mean_s": statistics.fmean(loads),
        "load_max_s": max(loads),
        "first_one_token_s": first,
        "first_one_token_max_s": max(first),
        "without_loads": quiet,
        "with_loads": loaded,
        "tok_s_ratio": loaded["tok_s"] / quiet["tok_s"] if quiet["tok_s"] else None,
        "requests": len(finished),
        "request_errors": len(errors),
        "first_errors": errors[:3],
    }


def vllm_env_versions(python: str) -> dict[str, str]:
    """Versions in vLLM's own environment, which is not the one this benchmark runs in."""
    code = "import torch, vllm, transformers; print(vllm.__version__, torch.__version__, transformers.__version__)"
    output = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout
    vllm_version, torch_version, transformers_version = output.split()[-3:]
    return {"vllm": vllm_version, "torch": torch_version, "transformers": transformers_version}


def log_tail(path: Path | None, lines: int = 40) -> str:
    if path is None or not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()
    settings = Settings.load(
        data_dir=args.data_dir, engine="vllm", vllm_url="", vllm_port=free_port(), base_model=args.base_model
    )
    base_path = resolve_base_model(settings.base_model, settings.data_dir / "models")
    with tempfile.TemporaryDirectory(prefix="kaizen-bench-engine-") as tmp:
        hot = args.hot_adapters if args.hot_streams else 0
        adapters = make_adapters(
            base_path, Path(tmp) / "adapters", 1 + args.new_adapters + hot, args.lora_rank
        )
        engine = build_vllm_engine(settings)
        if not isinstance(engine, VLLMEngine) or engine.launch is None:
            raise RuntimeError("the settings did not produce a vLLM engine the gateway starts itself")
        launch = engine.launch
        engine.log_path = Path(tmp) / "vllm.log"  # the data directory's vllm.log belongs to a real gateway
        served = engine.served_name
        lora = f"{ADAPTER_PREFIX}@0"
        try:
            logger.info("starting vLLM on port %d (model %s)", launch.port, launch.model)
            started = time.perf_counter()
            await engine.start()
            startup_s = time.perf_counter() - started
            await engine.load_adapter(lora, str(adapters[0]))
            for model in (served, lora):  # first calls compile/allocate; not part of the measurement
                await generate(engine, model, max(args.streams), 16)
            per_round = await measure_throughput(engine, {"base": served, "lora": lora}, args)
            new = adapters[1 : 1 + args.new_adapters]
            loads = await measure_adapter_loads(engine, new, served, args.latency_repeats)
            hot_reload = (
                await measure_hot_reload(engine, lora, adapters[1 + args.new_adapters :], args)
                if hot
                else None
            )
            if engine.restarts:
                raise RuntimeError(f"vLLM restarted {engine.restarts} time(s) during the benchmark")
        except BaseException:
            logger.error("vLLM log tail:\n%s", log_tail(engine.log_path))
            raise
        finally:
            await engine.close()
    medians = {side: {k: statistics.median(v) for k, v in runs.items()} for side, runs in per_round.items()}
    throughput = {
        streams: {
            "base_tok_s": medians["base"][streams],
            "lora_tok_s": medians["lora"][streams],
            "lora_over_base": medians["lora"][streams] / medians["base"][streams],
            "base_runs_tok_s": per_round["base"][streams],
            "lora_runs_tok_s": per_round["lora"][streams],
        }
        for streams in medians["base"]
    }
    versions = vllm_env_versions(launch.python)
    return {
        "benchmark": "vllm engine",
        "settings": {
            key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()
        },
        "vllm_command": launch.command(),
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_avg_before": load_before,
            "load_avg_after": os.getloadavg(),
            "vllm_env": versions,
        },
        "unix_time": int(time.time()),
        "startup_s": startup_s,
        "throughput": throughput,
        "adapters": loads,
        "hot_reload": hot_reload,
    }


def format_table(results: dict[str, Any]) -> str:
    machine, loads = results["machine"], results["adapters"]
    versions = machine["vllm_env"]
    lines = [
        f"vLLM {versions['vllm']} (torch {versions['torch']}) on {machine['cpus']} CPUs, "
        f"model {results['settings']['base_model']}, LoRA rank {results['settings']['lora_rank']}, "
        f"load average before/after {machine['load_avg_before'][0]:.2f}/{machine['load_avg_after'][0]:.2f}",
        f"{'start-up, spawn to /health 200':<40} {results['startup_s']:>8.1f} s",
        f"{'generation tok/s (median of rounds)':<40} {'base':>8} {'LoRA':>8} {'LoRA/base':>10}",
    ]
    for streams, row in results["throughput"].items():
        label = "1 stream" if streams == "1" else f"{streams} concurrent streams (aggregate)"
        lines.append(
            f"  {label:<38} {row['base_tok_s']:>8.1f} {row['lora_tok_s']:>8.1f} {row['lora_over_base']:>10.2f}"
        )
    lines += [
        f"{'adapter load (new name), mean / max':<40} {loads['load_mean_s']:>8.3f} {loads['load_max_s']:>8.3f} s",
        f"{'1-token request: base (median)':<40} {loads['base_one_token_median_s']:>8.3f} s",
        f"{'  first on a fresh adapter (mean)':<40} {loads['fresh_adapter_first_one_token_mean_s']:>8.3f} s"
        f"   x{loads['first_request_ratio']:.2f} base",
        f"{'  second on that adapter (mean)':<40} {loads['fresh_adapter_second_one_token_mean_s']:>8.3f} s",
    ]
    hot = results.get("hot_reload")
    if hot:
        quiet, loaded = hot["without_loads"], hot["with_loads"]
        lines += [
            f"hot reload under {hot['streams']} LoRA streams, a load every {hot['interval_s']:.1f} s:",
            f"{'  adapter load, mean / max':<40} {hot['load_mean_s']:>8.3f} {hot['load_max_s']:>8.3f} s",
            f"{'  first 1-token request on it, max':<40} {hot['first_one_token_max_s']:>8.3f} s",
            f"{'  streams tok/s without / with loads':<40} {quiet['tok_s']:>8.1f} {loaded['tok_s']:>8.1f}",
            f"{'  request median s without / with':<40} {quiet['request_median_s'] or 0:>8.2f} "
            f"{loaded['request_median_s'] or 0:>8.2f}",
            f"{'  requests, errors':<40} {hot['requests']:>8d} {hot['request_errors']:>8d}",
        ]
    lines += [
        f"greedy, {results['settings']['max_tokens']} tokens per request with ignore_eos; "
        f"{results['settings']['rounds']} alternating base/LoRA rounds",
    ]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=Path("kaizen-data"),
        help="where the base model is (pulled if missing)",
    )
    parser.add_argument("--base-model", default="smollm2-135m-instruct")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request")
    parser.add_argument(
        "--streams", type=int, nargs="+", default=[1, 8], help="concurrent requests per batch"
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternating base/LoRA rounds")
    parser.add_argument(
        "--new-adapters", type=int, default=3, help="adapter names loaded for the load timing"
    )
    parser.add_argument("--latency-repeats", type=int, default=3, help="base-model 1-token requests timed")
    parser.add_argument(
        "--hot-streams", type=int, default=4, help="streams generating during hot reloads (0: skip that part)"
    )
    parser.add_argument("--hot-adapters", type=int, default=4, help="adapter versions loaded under load")
    parser.add_argument("--hot-interval-s", type=float, default=3.0, help="seconds between those loads")
    args = parser.parse_args(argv)
    if (
        min(args.streams) < 1
        or min(args.rounds, args.new_adapters, args.latency_repeats, args.max_tokens, args.hot_adapters) < 1
        or args.hot_streams < 0
        or args.hot_interval_s <= 0
    ):
        parser.error(
            "streams, rounds, adapters, repeats, max tokens and the hot-reload interval must be positive"
        )
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    results = asyncio.run(benchmark(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    logger.info("\n%s\nresults written to %s", format_table(results), args.out)


if __name__ == "__main__":
    main()
