"""Training-step throughput and peak memory: Kaizen's GRPO update against TRL's ``GRPOTrainer``, same data.

Both sides get the identical pre-generated batch (prompts from the chat template, fixed completions, fixed
advantages), the same model (the embedded SmolLM2-135M-Instruct), the same LoRA (rank 16, alpha 32, all linear
layers), micro-batch, gradient accumulation and bf16 autocast, and do the same update: token-level (DAPO)
clipped policy-gradient loss, backward, AdamW step. TRL generates inside its step, so to compare only the
update its ``_prepare_inputs`` (generation + scoring) is replaced by the identity and its real
``training_step`` (autocast, ``compute_loss``, ``accelerator.backward``) runs on the fixed batch. Each side runs
in its own fresh process (peak RSS is per process), alternating, and the best round per side is reported. On a
CUDA device (``--device cuda``, the default where one is present) each side also reports its peak GPU memory.
TRL is measured twice: as ``GRPOConfig`` configures it (gradient checkpointing on) and without gradient
checkpointing (no recomputation, the faster setting on a small model); the headline ratio is against the faster.

    python -m tests.bench.bench_train [--steps 4] [--rounds 3] [--device cpu|cuda] [--model-dir DIR]
        [--out tests/bench/results/train.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import platform
import random
import resource
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from trainer.control.policy_config import TrainConfig

logger = logging.getLogger("bench_train")

GROUPS = 4
GENERATIONS = 4
MICRO_BATCH = 8
GRAD_ACCUMULATION = 2  # GROUPS * GENERATIONS = MICRO_BATCH * GRAD_ACCUMULATION sequences per optimizer step
COMPLETION_LENGTHS = (48, 160)
PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a haiku about autumn leaves.",
    "What is the difference between a list and a tuple in Python?",
    "Give three tips for writing clear emails.",
]


def make_data(model_dir: str, seed: int) -> list[dict[str, Any]]:
    """One optimizer step of data: prompt ids, completion ids (ending in end-of-turn) and an advantage each."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(seed)
    rows = []
    for prompt in PROMPTS[:GROUPS]:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        rewards = [rng.random() for _ in range(GENERATIONS)]
        mean = sum(rewards) / len(rewards)
        for reward in rewards:
            length = rng.randint(*COMPLETION_LENGTHS)
            completion = [rng.randrange(100, 40000) for _ in range(length - 1)] + [tokenizer.eos_token_id]
            rows.append({"prompt": list(ids), "completion": completion, "advantage": reward - mean})
    return rows


def bench_config(**overrides: Any) -> TrainConfig:
    """The policy settings of Kaizen's side: this batch's micro-batching, no collapse checks during the steps."""
    return TrainConfig(
        micro_batch_size=MICRO_BATCH,
        grad_accumulation=GRAD_ACCUMULATION,
        learning_rate=1e-5,
        collapse_check_every=0,
        **overrides,
    )


def tokenized(rows: list[dict[str, Any]]) -> list[Any]:
    """`make_data`'s rows as the trainer's samples (`trainer.learner.batch.TokenizedSample`)."""
    from trainer.learner.batch import TokenizedSample

    return [
        TokenizedSample(
            r["prompt"] + r["completion"],
            [False] * len(r["prompt"]) + [True] * len(r["completion"]),
            [None] * (len(r["prompt"]) + len(r["completion"])),
            r["advantage"],
        )
        for r in rows
    ]


def _peaks(device: str) -> dict[str, float]:
    """Peak host memory of this process and, on a GPU, the most device memory torch held at once."""
    peaks = {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if device == "cuda":
        import torch

        peaks["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return peaks


def _gpu_name() -> str:
    import torch

    return str(torch.cuda.get_device_name())


def run_kaizen(
    model_dir: str,
    rows: list[dict[str, Any]],
    steps: int,
    threads: int,
    device_name: str,
    *,
    compile_mode: Literal["auto", "on", "off"] = "auto",
    loader: str = "peft",
) -> dict[str, Any]:
    import torch

    from trainer.learner.grpo import run_update
    from trainer.learner.model import compile_layers, load_policy, uses_unsloth

    torch.set_num_threads(threads)
    cfg = bench_config(loader=loader, compile=compile_mode)
    device = torch.device(device_name)
    model, tokenizer = load_policy(model_dir, None, cfg, device)
    compiled = compile_layers(model, cfg, device, passes=(steps + 1) * GRAD_ACCUMULATION)
    samples = tokenized(rows)
    # The warm-up step (which compiles, where the layers are compiled) is timed apart.
    first = run_update(model, samples, cfg, pad_id=int(tokenizer.pad_token_id), device=device)
    elapsed = 0.0
    tokens = 0
    for _ in range(steps):
        result = run_update(model, samples, cfg, pad_id=int(tokenizer.pad_token_id), device=device)
        elapsed += result.metrics["update_s"]
        tokens += int(result.metrics["tokens"])
    return {
        "tokens": tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
        "loader": "unsloth" if uses_unsloth(device, cfg.loader) else "transformers",
        "compiled": compiled,
        "first_step_s": first.metrics["update_s"],
        **_peaks(device_name),
    }


def run_trl(
    model_dir: str,
    rows: list[dict[str, Any]],
    steps: int,
    threads: int,
    device_name: str,
    gradient_checkpointing: bool,
) -> dict[str, float]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # The frozen base in bf16, as Kaizen stores it on a bf16-capable CPU (TRL's `model_init_kwargs` can do the same).
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    cfg_defaults = TrainConfig()
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=MICRO_BATCH,
            gradient_accumulation_steps=GRAD_ACCUMULATION,
            num_generations=GENERATIONS,
            max_completion_length=COMPLETION_LENGTHS[1],
            loss_type="dapo",
            beta=0.0,
            learning_rate=1e-5,
            bf16=True,
            gradient_checkpointing=gradient_checkpointing,  # GRPOConfig's default is True
            use_cpu=device_name == "cpu",
            report_to=[],
            save_strategy="no",
            logging_steps=1,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **_: [0.0] * len(completions),
            args=args,
            train_dataset=Dataset.from_dict({"prompt": PROMPTS[:GROUPS] * GENERATIONS}),
            processing_class=tokenizer,
            peft_config=LoraConfig(
                r=cfg_defaults.lora_rank,
                lora_alpha=cfg_defaults.lora_alpha,
                lora_dropout=0.0,
                target_modules=cfg_defaults.target_modules,
                task_type="CAUSAL_LM",
            ),
        )
        trainer._prepare_inputs = lambda batch: batch  # fixed completions: no generation, no scoring
        trainer.current_gradient_accumulation_steps = GRAD_ACCUMULATION  # set by Trainer.train() otherwise
        trainer.create_optimizer()
        model = trainer.model
        if gradient_checkpointing and not model.is_gradient_checkpointing:  # Trainer.train() would enable it
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs
            )
        checkpointing = bool(model.is_gradient_checkpointing)
        model.train()
        pad = int(tokenizer.pad_token_id)
        micro = [rows[i : i + MICRO_BATCH] for i in range(0, len(rows), MICRO_BATCH)]
        total_completion = sum(len(r["completion"]) for r in rows)
        inputs = []
        for chunk in micro:
            pw = max(len(r["prompt"]) for r in chunk)
            cw = max(len(r["completion"]) for r in chunk)
            inputs.append(
                {
                    "prompt_ids": torch.tensor(
                        [[pad] * (pw - len(r["prompt"])) + r["prompt"] for r in chunk]
                    ),
                    "prompt_mask": torch.tensor(
                        [[0] * (pw - len(r["prompt"])) + [1] * len(r["prompt"]) for r in chunk]
                    ),
                    "completion_ids": torch.tensor(
                        [r["completion"] + [pad] * (cw - len(r["completion"])) for r in chunk]
                    ),
                    "completion_mask": torch.tensor(
                        [[1] * len(r["completion"]) + [0] * (cw - len(r["completion"])) for r in chunk]
                    ),
                    "advantages": torch.tensor([r["advantage"] for r in chunk]),
                    "num_items_in_batch": torch.tensor(float(total_completion)),
                }
            )
        # `_prepare_inputs` would have put the batch where the model is; with it replaced, this does.
        inputs = [{key: value.to(model.device) for key, value in batch.items()} for batch in inputs]
        tokens_per_step = sum(len(r["prompt"]) + len(r["completion"]) for r in rows)

        def step() -> None:
            for batch in inputs:
                trainer.training_step(model, batch, None)
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
            trainer.optimizer.step()
            trainer.optimizer.zero_grad(set_to_none=True)

        step()  # warm-up
        started = time.perf_counter()
        for _ in range(steps):
            step()
        elapsed = time.perf_counter() - started
    tokens = tokens_per_step * steps
    return {
        "tokens": tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
        **_peaks(device_name),
        "gradient_checkpointing": checkpointing,
    }


#: The sides measured: Kaizen as a long training run sets it up (on a GPU its decoder layers compiled, `train.compile`),
#: TRL as GRPOConfig configures it (gradient checkpointing on), and TRL without gradient checkpointing (faster, more
#: memory), the fairest speed comparison. On request only: Kaizen's update with nothing compiled (`train.compile =
#: "off"`), and with the base loaded through Unsloth (`train.loader = "unsloth"`; the `gpu` extra, on a CUDA device).
SIDES = ("kaizen", "trl", "trl-no-gc")
EXTRA_SIDES = ("kaizen-eager", "kaizen-unsloth")


def _side(
    side: str, model_dir: str, rows: list[dict[str, Any]], steps: int, threads: int, device: str
) -> dict[str, Any]:
    if side.startswith("kaizen"):
        # A long run on a GPU compiles (`train.compile = "auto"`); this one is short, so it is asked for.
        compile_mode = "on" if device == "cuda" and side == "kaizen" else "off"
        loader = "unsloth" if side == "kaizen-unsloth" else "peft"
        return run_kaizen(model_dir, rows, steps, threads, device, compile_mode=compile_mode, loader=loader)
    return run_trl(model_dir, rows, steps, threads, device, gradient_checkpointing=side == "trl")


def _report(target: Callable[..., dict[str, Any]], args: tuple[Any, ...], queue: Any) -> None:
    logging.disable(logging.WARNING)
    try:
        queue.put(target(*args))
    except BaseException:
        queue.put({"error": traceback.format_exc()})
        raise


def in_fresh_process(target: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """`target(*args)` in a new process (its own peak memory, nothing imported or compiled before it): its result,
    or ``{"error": traceback}``."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=_report, args=(target, args, queue))
    process.start()
    result: dict[str, Any] = queue.get()
    process.join()
    return result


def measure(
    side: str, model_dir: str, rows: list[dict[str, Any]], steps: int, threads: int, device: str
) -> dict[str, Any]:
    result = in_fresh_process(_side, side, model_dir, rows, steps, threads, device)
    if "error" in result:
        raise RuntimeError(f"{side} run failed:\n{result['error']}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, default=Path("kaizen-data/models/smollm2-135m-instruct"))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda where a GPU is present")
    parser.add_argument(
        "--sides",
        nargs="+",
        choices=SIDES + EXTRA_SIDES,
        default=list(SIDES),
        help="what to measure (default: Kaizen and both TRL configurations)",
    )
    parser.add_argument("--out", type=Path, default=Path("tests/bench/results/train.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if not args.model_dir.is_dir():
        from gateway.base_models import pull_base_model

        args.model_dir = pull_base_model("smollm2-135m-instruct", args.model_dir.parent)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = make_data(str(args.model_dir), seed=0)
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in args.sides}
    # On a GPU the memory that limits the batch is the device's; on a CPU it is the process's.
    memory = "peak_gpu_mib" if args.device == "cuda" else "peak_rss_mib"
    failed: dict[str, str] = {}
    for round_index in range(args.rounds):
        for side in [s for s in args.sides if s not in failed]:
            try:
                result = measure(side, str(args.model_dir), rows, args.steps, args.threads, args.device)
            except RuntimeError as error:  # reported; the other sides still run (a GPU's time is short)
                logger.error("%s", error)
                failed[side] = str(error)[-2000:]
                continue
            runs[side].append(result)
            logger.info(
                "round %d %-9s %7.1f tokens/s  %s %6.0f",
                round_index,
                side,
                result["tokens_per_s"],
                memory,
                result[memory],
            )
    sides = [side for side in args.sides if runs[side]]
    best = {side: max(runs[side], key=lambda r: r["tokens_per_s"]) for side in sides}
    # The headline ratio is taken against whichever TRL configuration measured was faster.
    rivals = [side for side in sides if not side.startswith("kaizen")]
    rival = max(rivals, key=lambda side: best[side]["tokens_per_s"]) if rivals else None
    kaizen = best.get("kaizen")
    summary = {
        "method": (
            "identical fixed batch per optimizer step; TRL GRPOTrainer.training_step with _prepare_inputs replaced "
            "by the identity (no generation or scoring), Kaizen trainer.learner.grpo.run_update; all: bf16 base weights, "
            "LoRA r16/alpha32 on all linear layers, bf16 autocast, token-level (DAPO) loss, AdamW; TRL with its "
            "default gradient checkpointing and without; fresh process per run, best round per side"
        ),
        "model": str(args.model_dir.name),
        "sequences_per_step": len(rows),
        "micro_batch": MICRO_BATCH,
        "grad_accumulation": GRAD_ACCUMULATION,
        "tokens_per_step": sum(len(r["prompt"]) + len(r["completion"]) for r in rows),
        "steps": args.steps,
        "rounds": args.rounds,
        "threads": args.threads,
        "cpu": platform.processor() or platform.machine(),
        "device": args.device,
        "gpu": _gpu_name() if args.device == "cuda" else None,
        "runs": runs,
        "failed": failed,
        **{f"{side}_tokens_per_s": best[side]["tokens_per_s"] for side in sides},
        **{f"{side}_{memory}": best[side][memory] for side in sides},
        "kaizen_loader": kaizen["loader"] if kaizen else None,
        "compared_with": rival,
        "speedup": kaizen["tokens_per_s"] / best[rival]["tokens_per_s"] if kaizen and rival else None,
        "memory_ratio": kaizen[memory] / best[rival][memory] if kaizen and rival else None,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    headers = {
        "kaizen": "Kaizen",
        "trl": "TRL (defaults: grad. checkpointing)",
        "trl-no-gc": "TRL (no checkpointing)",
        "kaizen-eager": "Kaizen (nothing compiled)",
        "kaizen-unsloth": "Kaizen (Unsloth)",
    }
    table = [
        "| | " + " | ".join(headers[side] for side in sides) + " |",
        "|---" * (len(sides) + 1) + "|",
        "| trained tokens/s | " + " | ".join(f"{best[side]['tokens_per_s']:.0f}" for side in sides) + " |",
        f"| {memory} | " + " | ".join(f"{best[side][memory]:.0f}" for side in sides) + " |",
    ]
    if kaizen and rivals:
        for label, key in (("speed-up", "tokens_per_s"), ("memory", memory)):
            cells = ["" if side == "kaizen" else f"{kaizen[key] / best[side][key]:.2f}×" for side in sides]
            table.append(f"| Kaizen's {label} | " + " | ".join(cells) + " |")
    sys.stdout.write("\n".join(table) + "\n" + summary["method"] + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
