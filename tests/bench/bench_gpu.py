"""The GPU path on one CUDA machine: serving, hot reload, training and the whole loop, with memory traced.

Each phase runs as its own process, the way a user runs it, while `nvidia-smi` samples the GPU's memory every
half second; the summary (rewritten after each phase) gives each phase's peak and what it printed. The phases,
run in the order ``--phases`` names them:

1. ``model``: a real-size Llama-shaped model with random weights (``--shape``) built from a config on the GPU,
   with the embedded model's tokenizer and chat template (no model hub is needed).
2. ``engine``: ``bench_engine`` against it: vLLM's CUDA build started as the gateway starts it, generation
   throughput through the base model and through a LoRA adapter at each ``--streams``, adapter loads, and hot
   reload under load (``--hot-streams`` LoRA streams running while new adapter versions are loaded).
3. ``train``: ``bench_train`` on it: Kaizen's GRPO update (layers compiled, as a run on a GPU does, and not)
   against TRL's on the same batch, on the GPU.
4. ``unsloth``: Kaizen's update with the base loaded through Unsloth (``train.loader = "unsloth"``) beside the
   same update through transformers + PEFT, in one run (``--unsloth-site``: a directory where the ``gpu`` extra is
   installed, put first on that phase's path).
5. ``demo``: ``kaizen demo`` with the embedded model, the engine put to sleep while each training child runs
   (``KAIZEN_ENGINE_SLEEP_DURING_TRAINING``), so traffic, rewards, training, the gate and hot reloads of the
   promoted adapters all run on the one GPU. Preparing the model, vLLM's start-up with sleep mode and each
   training round (which samples with the trainer's own copy while the engine sleeps) took 50 s, 95 s and
   100 s on an H100, so give it ``--demo-minutes`` to match; it ends earlier once a cycle answered by a
   promoted version reaches the task's target reward (``kaizen demo --stop-at-target``).

    python -m tests.bench.bench_gpu --out-dir tests/bench/results/gpu [--phases model engine train unsloth demo]

The ``engine`` and ``demo`` phases need vLLM's CUDA build (``make install-vllm VLLM_BUILD=gpu`` puts it in
``.venv-vllm``; pass that interpreter as ``KAIZEN_VLLM_PYTHON``). Random weights make the served text noise;
throughput and memory do not depend on it.

``model`` and ``train`` need only a CUDA build of torch and the training stack, so they also run on a GPU machine
that has torch but no network (how the 2026-12-06 run was made): download the wheels of the pinned versions
(``requirements/app.txt``: transformers, tokenizers, huggingface_hub, safetensors, accelerate, peft, trl, datasets,
fsspec, dill, multiprocess, and for Kaizen's own imports pydantic, pydantic_core, annotated-types,
typing-inspection, typing_extensions, msgspec, SQLAlchemy, greenlet, zstandard) with ``pip download --no-deps
--only-binary=:all: --python-version <its Python> --platform manylinux2014_x86_64 ...``, copy them and the
embedded model's tokenizer files over, ``pip install --no-index --no-deps --target DIR`` them there, put ``DIR``
and the checkout on ``PYTHONPATH``, and pass ``--tokenizer-from`` the tokenizer's directory."""

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

PHASES = ("model", "engine", "train", "unsloth", "demo")
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
    """Run the phases in the order given; the summary is rewritten after each, so a cut-off run keeps its news."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu needs a CUDA GPU")
    out: Path = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    work: Path = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
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
        for name in args.phases:
            PHASE_RUNNERS[name](args, summary, trace)
            (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def add_results(summary: dict[str, Any], name: str, path: Path) -> None:
    """What a phase's benchmark wrote, under `<name>_results`; a phase that wrote nothing adds nothing (a file
    from an earlier run is not this run's)."""
    if path.is_file():
        summary[f"{name}_results"] = json.loads(path.read_text())


def _base_env() -> dict[str, str]:
    return {**os.environ, "KAIZEN_VLLM_PYTHON": os.environ.get("KAIZEN_VLLM_PYTHON", sys.executable)}


def _model_dir(args: argparse.Namespace) -> Path:
    return Path(args.work_dir) / f"random-{args.shape}"


def phase_model(args: argparse.Namespace, summary: dict[str, Any], trace: MemoryTrace) -> None:
    from gateway.base_models import pull_base_model

    trace.phase = "model"
    tokenizer_dir = args.tokenizer_from or pull_base_model("smollm2-135m-instruct", args.work_dir / "models")
    summary["model"] = build_random_model(args.shape, Path(tokenizer_dir), _model_dir(args))
    summary["phases"]["model"] = {"peak_gpu_mib": trace.peak("model")}
    trace.phase = "idle"
    logger.info("random model: %s", summary["model"])


def phase_engine(args: argparse.Namespace, summary: dict[str, Any], trace: MemoryTrace) -> None:
    phase = run_phase(
        "engine",
        [sys.executable, "-m", "tests.bench.bench_engine", "--base-model", str(_model_dir(args)),
         "--data-dir", str(args.work_dir / "engine-data"), "--out", str(args.out_dir / "engine.json"),
         "--streams", *[str(s) for s in args.streams], "--rounds", str(args.rounds),
         "--max-tokens", str(args.max_tokens), "--hot-streams", str(args.hot_streams),
         "--hot-adapters", str(args.hot_adapters), "--hot-interval-s", str(args.hot_interval_s)],
        _base_env() | {"KAIZEN_VLLM_EXTRA_ARGS": args.engine_args},
        args.phase_timeout_s, trace, args.out_dir,
    )  # fmt: skip
    summary["phases"]["engine"] = phase.__dict__
    add_results(summary, "engine", args.out_dir / "engine.json")


def run_bench_train(
    args: argparse.Namespace,
    summary: dict[str, Any],
    trace: MemoryTrace,
    name: str,
    env: dict[str, str],
    extra: list[str],
) -> None:
    """`bench_train` on the random model on the GPU as phase `name`, its results in `<name>.json`."""
    result = args.out_dir / f"{name}.json"
    phase = run_phase(
        name,
        [sys.executable, "-m", "tests.bench.bench_train", "--model-dir", str(_model_dir(args)),
         "--device", "cuda", "--steps", str(args.train_steps), "--rounds", "1", *extra, "--out", str(result)],
        env, args.phase_timeout_s, trace, args.out_dir,
    )  # fmt: skip
    summary["phases"][name] = phase.__dict__
    add_results(summary, name, result)


def phase_train(args: argparse.Namespace, summary: dict[str, Any], trace: MemoryTrace) -> None:
    """Kaizen's update as a run sets it up (layers compiled) and with nothing compiled, beside TRL's two setups."""
    sides = [
        "kaizen-eager",
        "trl-no-gc",
        "kaizen",
        "trl",
    ]  # the compiled side may fail: the others come first
    run_bench_train(args, summary, trace, "train", _base_env(), ["--sides", *sides])


def phase_unsloth(args: argparse.Namespace, summary: dict[str, Any], trace: MemoryTrace) -> None:
    """Kaizen's update with the base loaded through Unsloth (the policy's opt-in) beside the plain one, one run."""
    env = _base_env()
    if args.unsloth_site is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(args.unsloth_site), env.get("PYTHONPATH")]))
    probe = [
        sys.executable,
        "-c",
        "import importlib.util, sys; sys.exit(importlib.util.find_spec('unsloth') is None)",
    ]
    if subprocess.run(probe, env=env, check=False).returncode != 0:
        reason = "Unsloth is not installed: `pip install '.[gpu]'`, or pass --unsloth-site"
        logger.error("phase unsloth skipped: %s", reason)
        summary["phases"]["unsloth"] = {"name": "unsloth", "skipped": reason}
        return
    run_bench_train(args, summary, trace, "unsloth", env, ["--sides", "kaizen-eager", "kaizen-unsloth"])


def phase_demo(args: argparse.Namespace, summary: dict[str, Any], trace: MemoryTrace) -> None:
    demo_out = args.work_dir / "demo"  # its database and adapters stay there; the report is copied to out
    phase = run_phase(
        "demo",
        [sys.executable, "-m", "gateway", "demo", "--out", str(demo_out), "--data-dir", str(args.work_dir),
         "--minutes", str(args.demo_minutes), "--rate", str(args.demo_rate),
         "--concurrency", str(args.demo_concurrency), "--task", args.demo_task, "--stop-at-target"],
        _base_env() | {
            "KAIZEN_VLLM_EXTRA_ARGS": args.demo_engine_args,
            "KAIZEN_ENGINE_SLEEP_DURING_TRAINING": "true",
            "VLLM_SERVER_DEV_MODE": "1",
        },
        args.demo_minutes * 60 + args.phase_timeout_s, trace, args.out_dir,
    )  # fmt: skip
    summary["phases"]["demo"] = phase.__dict__ | {"engine_sleep": sleep_lines(demo_out / "data")}
    for name in ("demo.json", "demo.png"):
        if (demo_out / name).is_file():
            shutil.copy(demo_out / name, args.out_dir / name)
    add_results(summary, "demo", demo_out / "demo.json")


PHASE_RUNNERS = {
    "model": phase_model,
    "engine": phase_engine,
    "train": phase_train,
    "unsloth": phase_unsloth,
    "demo": phase_demo,
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out-dir", type=Path, default=Path("tests/bench/results/gpu"))
    parser.add_argument(
        "--work-dir", type=Path, default=Path("kaizen-data/bench-gpu"), help="models and data"
    )
    parser.add_argument(
        "--phases", nargs="+", choices=PHASES, default=list(PHASES), help="run in the order given"
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="3b")
    parser.add_argument("--tokenizer-from", type=Path, help="model directory (default: the embedded model)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--hot-streams", type=int, default=32, help="streams served during hot reloads")
    parser.add_argument("--hot-adapters", type=int, default=5, help="adapter versions loaded under load")
    parser.add_argument("--hot-interval-s", type=float, default=3.0)
    parser.add_argument("--train-steps", type=int, default=3)
    parser.add_argument(
        "--unsloth-site",
        type=Path,
        help="a directory with Unsloth installed, put first on the path of that phase",
    )
    parser.add_argument("--engine-args", default=ENGINE_ARGS, help="vLLM flags for the engine phase")
    parser.add_argument("--demo-engine-args", default=DEMO_ENGINE_ARGS, help="vLLM flags for the demo")
    parser.add_argument("--demo-minutes", type=float, default=10.0)
    parser.add_argument("--demo-rate", type=float, default=4.0)
    parser.add_argument("--demo-concurrency", type=int, default=16)
    parser.add_argument("--demo-task", default="opposites")
    parser.add_argument("--phase-timeout-s", type=float, default=240.0, help="longest run of one phase")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    benchmark(args)
    logger.info("summary written to %s", args.out_dir / "summary.json")


if __name__ == "__main__":
    main()
