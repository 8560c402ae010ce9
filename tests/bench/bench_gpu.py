"""The GPU path on one CUDA machine: serving, hot reload, training and the whole loop, with memory traced.

Each phase runs as its own process, the way a user runs it, while `nvidia-smi` samples the GPU's memory every
half second; the summary gives each phase's peak and what it printed. The phases:

1. ``model``: a real-size Llama-shaped model with random weights (``--shape``) built from a config on the GPU,
   with the embedded model's tokenizer and chat template (no model hub is needed).
2. ``engine``: ``bench_engine`` against it: vLLM's CUDA build started as the gateway starts it, generation
   throughput through the base model and through a LoRA adapter at each ``--streams``, and adapter loads.
3. ``train``: ``bench_train`` on it: Kaizen's GRPO update against TRL's on the same batch, on the GPU.
4. ``demo``: ``kaizen demo`` with the embedded model, the engine put to sleep while each training child runs
   (``KAIZEN_ENGINE_SLEEP_DURING_TRAINING``), so traffic, rewards, training, the gate and hot reloads of the
   promoted adapters all run on the one GPU.

    python -m tests.bench.bench_gpu --out-dir tests/bench/results/gpu [--phases model engine train demo]

It needs vLLM's CUDA build in the Python it runs under (``make install-vllm VLLM_BUILD=gpu`` puts it in
``.venv-vllm``; pass that interpreter as ``KAIZEN_VLLM_PYTHON``). Random weights make the served text noise;
throughput and memory do not depend on it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("bench_gpu")

PHASES = ("model", "engine", "train", "demo")
#: Llama-shaped models by their size with the embedded tokenizer (49,152 tokens): hidden size, layers,
#: attention heads, key/value heads and MLP width, as the public 1B, 3B and 8B models of that family have.
SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "1b": (2048, 16, 32, 8, 8192),
    "3b": (3072, 28, 24, 8, 8192),
    "8b": (4096, 32, 32, 8, 14336),
}
#: vLLM flags for the phases that start it: eager mode (CUDA graphs and compilation take longer to set up than
#: these short runs last) and a share of the GPU that leaves the trainer room in the same phase.
ENGINE_ARGS = "--enforce-eager --gpu-memory-utilization 0.45"
DEMO_ENGINE_ARGS = "--enforce-eager --gpu-memory-utilization 0.3 --enable-sleep-mode"
#: vLLM's own report of each sleep and wake: what was freed and how long each took.
_SLEEP_LINE = re.compile(r"Sleep mode freed|seconds to fall asleep|seconds to wake up")


def build_random_model(
    shape: str, tokenizer_dir: Path, out_dir: Path, device: str = "cuda"
) -> dict[str, Any]:
    """A Llama model of `shape` with random bf16 weights, made on the GPU and saved with the tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv_heads, mlp = SHAPES[shape]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=8192,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    started = time.perf_counter()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # made in bf16 on the GPU: no fp32 copy in host memory
    with torch.device(device):
        model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    torch.set_default_dtype(torch.float32)
    parameters = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return {
        "shape": shape,
        "parameters": parameters,
        "path": str(out_dir),
        "build_s": time.perf_counter() - started,
    }


class MemoryTrace:
    """`nvidia-smi` sampling used GPU memory every half second, with the phase each sample fell in."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.phase = "idle"
        self.samples: list[tuple[float, str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> MemoryTrace:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(5)
        lines = [f"{t:.1f},{phase},{mib:.0f}" for t, phase, mib in self.samples]
        self.path.write_text("seconds,phase,used_mib\n" + "\n".join(lines) + "\n")

    def _sample(self) -> None:
        started = time.monotonic()
        while not self._stop.wait(0.5):
            used = gpu_query("memory.used")
            if used:
                self.samples.append((time.monotonic() - started, self.phase, float(used.split()[0])))

    def peak(self, phase: str) -> float | None:
        values = [mib for _, p, mib in self.samples if p == phase]
        return max(values) if values else None


def gpu_query(field: str) -> str:
    """One `nvidia-smi --query-gpu` field of the first GPU, or '' where it cannot be read."""
    try:
        done = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else ""


@dataclass
class Phase:
    """What one phase's process did."""

    name: str
    returncode: int | None
    seconds: float
    peak_gpu_mib: float | None
    log_tail: str


def run_phase(
    name: str, argv: list[str], env: dict[str, str], timeout_s: float, trace: MemoryTrace, log_dir: Path
) -> Phase:
    """Run one phase as a child process, its output to `log_dir/<name>.log`; a timeout kills its group."""
    trace.phase = name
    log_path = log_dir / f"{name}.log"
    logger.info("phase %s: %s", name, " ".join(argv))
    started = time.perf_counter()
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            returncode: int | None = process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logger.error("phase %s ran past %.0f s: stopping it", name, timeout_s)
            os.killpg(process.pid, 15)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, 9)
                process.wait()
            returncode = None
    seconds = time.perf_counter() - started
    trace.phase = "idle"
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
    logger.info("phase %s: exit %s after %.0f s", name, returncode, seconds)
    return Phase(name, returncode, seconds, trace.peak(name), tail)


def sleep_lines(data_dir: Path) -> list[str]:
    """What vLLM logged about falling asleep and waking up during the demo."""
    log = data_dir / "logs" / "vllm.log"
    if not log.is_file():
        return []
    return [
        line.strip()[-240:]
        for line in log.read_text(errors="replace").splitlines()
        if _SLEEP_LINE.search(line)
    ]


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from gateway.base_models import pull_base_model

    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu needs a CUDA GPU")
    out: Path = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    work: Path = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    env = {**os.environ, "KAIZEN_VLLM_PYTHON": os.environ.get("KAIZEN_VLLM_PYTHON", python)}
    model_dir = work / f"random-{args.shape}"
    summary: dict[str, Any] = {
        "benchmark": "gpu path",
        "gpu": gpu_query("name"),
        "gpu_memory_total_mib": gpu_query("memory.total"),
        "driver": gpu_query("driver_version"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "unix_time": int(time.time()),
        "phases": {},
    }
    with MemoryTrace(out / "gpu-memory.csv") as trace:
        if "model" in args.phases:
            trace.phase = "model"
            tokenizer_dir = args.tokenizer_from or pull_base_model("smollm2-135m-instruct", work / "models")
            summary["model"] = build_random_model(args.shape, Path(tokenizer_dir), model_dir)
            summary["phases"]["model"] = {"peak_gpu_mib": trace.peak("model")}
            trace.phase = "idle"
            logger.info("random model: %s", summary["model"])
        if "engine" in args.phases:
            phase = run_phase(
                "engine",
                [python, "-m", "tests.bench.bench_engine", "--base-model", str(model_dir),
                 "--data-dir", str(work / "engine-data"), "--out", str(out / "engine.json"),
                 "--streams", *[str(s) for s in args.streams], "--rounds", str(args.rounds),
                 "--max-tokens", str(args.max_tokens)],
                env | {"KAIZEN_VLLM_EXTRA_ARGS": args.engine_args},
                args.phase_timeout_s, trace, out,
            )  # fmt: skip
            summary["phases"]["engine"] = phase.__dict__
        if "train" in args.phases:
            phase = run_phase(
                "train",
                [python, "-m", "tests.bench.bench_train", "--model-dir", str(model_dir), "--device", "cuda",
                 "--steps", str(args.train_steps), "--rounds", "1", "--out", str(out / "train.json")],
                env, args.phase_timeout_s, trace, out,
            )  # fmt: skip
            summary["phases"]["train"] = phase.__dict__
        if "demo" in args.phases:
            demo_out = work / "demo"  # its database and adapters stay there; the report is copied to out
            phase = run_phase(
                "demo",
                [python, "-m", "gateway", "demo", "--out", str(demo_out), "--data-dir", str(work),
                 "--minutes", str(args.demo_minutes), "--rate", str(args.demo_rate),
                 "--concurrency", str(args.demo_concurrency), "--task", args.demo_task],
                env | {
                    "KAIZEN_VLLM_EXTRA_ARGS": args.demo_engine_args,
                    "KAIZEN_ENGINE_SLEEP_DURING_TRAINING": "true",
                    "VLLM_SERVER_DEV_MODE": "1",
                },
                args.demo_minutes * 60 + args.phase_timeout_s, trace, out,
            )  # fmt: skip
            summary["phases"]["demo"] = phase.__dict__ | {"engine_sleep": sleep_lines(demo_out / "data")}
            for name in ("demo.json", "demo.png"):
                if (demo_out / name).is_file():
                    shutil.copy(demo_out / name, out / name)
    for name in ("engine", "train", "demo"):
        if (out / f"{name}.json").is_file():
            summary[f"{name}_results"] = json.loads((out / f"{name}.json").read_text())
    return summary


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out-dir", type=Path, default=Path("tests/bench/results/gpu"))
    parser.add_argument(
        "--work-dir", type=Path, default=Path("kaizen-data/bench-gpu"), help="models and data"
    )
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    parser.add_argument("--shape", choices=sorted(SHAPES), default="3b")
    parser.add_argument("--tokenizer-from", type=Path, help="model directory (default: the embedded model)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--train-steps", type=int, default=3)
    parser.add_argument("--engine-args", default=ENGINE_ARGS, help="vLLM flags for the engine phase")
    parser.add_argument("--demo-engine-args", default=DEMO_ENGINE_ARGS, help="vLLM flags for the demo")
    parser.add_argument("--demo-minutes", type=float, default=2.5)
    parser.add_argument("--demo-rate", type=float, default=4.0)
    parser.add_argument("--demo-concurrency", type=int, default=16)
    parser.add_argument("--demo-task", default="opposites")
    parser.add_argument("--phase-timeout-s", type=float, default=240.0, help="longest run of one phase")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    summary = benchmark(args)
    path = args.out_dir / "summary.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    logger.info("summary written to %s", path)


if __name__ == "__main__":
    main()
