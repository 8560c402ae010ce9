"""One optimizer step's gradients of the embedded model's LoRA, in one process or under torchrun.

    python -m tests.support.distributed_step --model DIR --out grads.pt
    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.support.distributed_step \\
        --model DIR --out grads.pt --sharding fsdp

Every process builds the same model (the base, and a LoRA whose B is seeded non-zero so every LoRA matrix gets a
gradient), the same six trajectories of different lengths and one optimizer step of three micro-batches of two
(so with two processes one of them also runs a zero-weighted pass), and accumulates that step's gradients through
`trainer.learner.grpo.accumulate_step`, the trainer's own code. Rank 0 writes every LoRA gradient as a whole tensor to
`--out`, for `tests/integration/test_distributed_training.py` to compare.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch

from trainer.control.launch import ranks_from_environment
from trainer.control.policy_config import TrainConfig
from trainer.learner.batch import TokenizedSample
from trainer.learner.distributed import shard, start, stop
from trainer.learner.grpo import StepTotals, accumulate_step, plan_steps
from trainer.learner.model import load_policy

LENGTHS = (19, 23, 31, 12, 27, 16)


def samples(vocab: int) -> list[TokenizedSample]:
    generator = torch.Generator().manual_seed(1)
    out = []
    for number, length in enumerate(LENGTHS):
        ids = torch.randint(0, vocab, (length,), generator=generator).tolist()
        prompt = length // 3
        mask = [False] * prompt + [True] * (length - prompt)
        behaviour = [None] * prompt + [-0.5 - 0.01 * i for i in range(length - prompt)]
        out.append(TokenizedSample(ids, mask, behaviour, advantage=(-1.0) ** number * (0.5 + 0.1 * number)))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", required=True, help="the base model's directory")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sharding", choices=["fsdp", "ddp"], default="fsdp")
    args = parser.parse_args(argv)
    ranks = ranks_from_environment()
    device = start(ranks) if ranks is not None else torch.device("cpu")
    cfg = TrainConfig(micro_batch_size=2, grad_accumulation=3, lora_rank=4, seed=3)
    model, tokenizer = load_policy(args.model, None, cfg, device)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    if ranks is not None:
        model = shard(model, args.sharding, device)
    batch = samples(int(tokenizer.vocab_size))
    [window] = plan_steps(list(range(len(batch))), [len(s.input_ids) for s in batch], 2, 3)
    model.train()
    accumulate_step(
        model,
        batch,
        window,
        cfg,
        pad_id=int(tokenizer.pad_token_id),
        device=device,
        old={},
        first_epoch=True,
        totals=StepTotals(),
        ranks=ranks,
    )
    grads = {}
    for name, parameter in model.named_parameters():
        if parameter.requires_grad and parameter.grad is not None:
            grad = parameter.grad
            whole = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
            grads[name.removeprefix("module.")] = whole.detach().cpu().clone()
    if ranks is None or ranks.main:
        torch.save(grads, args.out)
    if ranks is not None:
        stop()


if __name__ == "__main__":
    main()
