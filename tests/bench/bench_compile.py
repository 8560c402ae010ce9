"""What `train.compile` costs and gives on one device: the first steps compiled and eager, and sampling between.

Each mode runs in a fresh process, as a training run does: `load_policy`, `compile_layers` (``on``: compiled
whatever the run's length; ``off``: eager), then three `run_update` calls on `bench_train`'s batch (16 sequences,
one optimizer step each), each timed to the device's last kernel. The first call pays the compilation; the other
two are the step a long run repeats. Between the second and the third the trainer's own sampler generates 4
replies of 16 tokens (under inference mode, so eager), and the count of compiled graphs is read after the third:
sampling must not have compiled anything. `COMPILE_MIN_PASSES`, where `train.compile = "auto"` starts compiling,
comes from these numbers (compile time over the time a pass saves).

    python -m tests.bench.bench_compile --model-dir DIR [--device cuda] [--modes off on] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Literal

from tests.bench.bench_train import GRAD_ACCUMULATION, bench_config, in_fresh_process, make_data, tokenized

logger = logging.getLogger("bench_compile")

UPDATES = 3


def run_mode(model_dir: str, mode: Literal["on", "off"], device_name: str) -> dict[str, Any]:
    """One process's load, compilation (or not), timed updates and sampling."""
    import torch
    from torch._dynamo.utils import counters

    from trainer.learner.grpo import run_update
    from trainer.learner.model import LocalSampler, compile_layers, load_policy

    device = torch.device(device_name)
    cfg = bench_config(compile=mode)
    started = time.perf_counter()
    model, tokenizer = load_policy(model_dir, None, cfg, device)
    compiled = compile_layers(model, cfg, device, passes=UPDATES * GRAD_ACCUMULATION)
    load_s = time.perf_counter() - started
    samples = tokenized(make_data(model_dir, seed=0))
    update_s: list[float] = []
    sample_s = 0.0
    for index in range(UPDATES):
        started = time.perf_counter()
        run_update(model, samples, cfg, pad_id=int(tokenizer.pad_token_id), device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        update_s.append(time.perf_counter() - started)
        if index == 1:
            sampler = LocalSampler(model, tokenizer, device, max_new_tokens=16)
            started = time.perf_counter()
            sampler.sample_many([([{"role": "user", "content": "Say hi."}], None)], 4)
            sample_s = time.perf_counter() - started
    return {
        "mode": mode,
        "compiled": compiled,
        "load_s": load_s,
        "update_s": update_s,
        "sample_s": sample_s,
        "unique_graphs": counters["stats"]["unique_graphs"],
    }


def measure(model_dir: str, mode: Literal["on", "off"], device: str) -> dict[str, Any]:
    return {"mode": mode, **in_fresh_process(run_mode, model_dir, mode, device)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--modes", nargs="+", choices=("off", "on"), default=["off", "on"])
    parser.add_argument("--out", type=Path, default=Path("tests/bench/results/gpu/train-compile.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    runs = []
    for mode in args.modes:
        result = measure(str(args.model_dir), mode, args.device)
        runs.append(result)
        if "error" in result:
            logger.error("%s failed:\n%s", mode, result["error"])
            continue
        logger.info(
            "%-3s first update %6.1f s, then %s s; sampling %.2f s; %d compiled graphs",
            mode,
            result["update_s"][0],
            " ".join(f"{s:.3f}" for s in result["update_s"][1:]),
            result["sample_s"],
            result["unique_graphs"],
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"model": args.model_dir.name, "device": args.device, "runs": runs}, indent=2)
    )
    return 1 if any("error" in run for run in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
