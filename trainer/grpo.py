"""The GRPO update: micro-batched forward/backward of ``trainer.loss.policy_loss`` with gradient accumulation,
progress logging, and collapse checks that stop the run early.

π_old of a sample is the policy when the sample is first visited: in the first epoch the ratio is exactly 1
(one step per batch, as in GRPO with one iteration); later epochs reuse the first pass's logprobs, so the PPO/CISPO
clip bounds how far repeated passes move each token.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from trainer.batch import Batch, TokenizedSample, collate, token_entropy, token_logprobs
from trainer.collapse import CollapseBounds, CollapseSignals, check, measure
from trainer.distributed import gather_objects, my_micro_batches, share
from trainer.launch import Ranks
from trainer.loss import policy_loss
from trainer.model import LocalSampler, autocast
from trainer.policy_config import TrainConfig

logger = logging.getLogger(__name__)

#: Called after optimizer steps to test for collapse; returns violated bounds (empty: fine).
CollapseCheck = Callable[[int], list[str]]


class Interrupted(Exception):
    """The run was asked to stop (signal, lost lock) before it finished."""


@dataclass
class UpdateResult:
    """Metrics of one training run's update phase."""

    steps: int = 0
    stopped_early: bool = False
    problems: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


def _forward_logprobs(model: Any, batch: Batch, device: torch.device, start: int = 0) -> Tensor:
    """Logprobs of ``batch.targets[:, start:]``; logits are computed only from column `start` on.

    The vocabulary projection is a large share of a small model's compute, and prompt positions carry no loss.
    """
    with autocast(device):
        logits = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            logits_to_keep=batch.input_ids.shape[1] - start,
        ).logits
    return token_logprobs(logits, batch.targets[:, start:])


def _first_loss_column(batch: Batch) -> int:
    columns = batch.loss_mask.any(dim=0).nonzero()
    return int(columns[0]) if columns.numel() else 0


def plan_steps(
    order: list[int], lengths: Sequence[int], micro_batch: int, accumulation: int
) -> list[list[list[int]]]:
    """Split a shuffled epoch into optimizer steps of ``micro_batch * accumulation`` samples, each a list of
    micro-batches.

    Which samples share a step is decided by the shuffle alone; inside a step they are sorted by length before
    being cut into micro-batches, so each micro-batch pads to a similar length. The accumulated gradient of the
    step is unchanged (every micro-batch is normalised by the step's token count), only less padding is
    computed. Longest first: a micro-batch that does not fit in memory fails at the start of the run.
    """
    per_step = micro_batch * accumulation
    steps = []
    for start in range(0, len(order), per_step):
        window = sorted(order[start : start + per_step], key=lambda i: -lengths[i])
        steps.append([window[i : i + micro_batch] for i in range(0, len(window), micro_batch)])
    return steps


@dataclass
class StepTotals:
    """What the passes of an update counted on this process: tokens, and metric sums weighted by tokens."""

    loss_tokens: int = 0
    seen_tokens: int = 0
    sums: dict[str, float] = field(default_factory=dict)


def accumulate_step(
    model: Any,
    samples: Sequence[TokenizedSample],
    window: Sequence[list[int]],
    cfg: TrainConfig,
    *,
    pad_id: int,
    device: torch.device,
    old: dict[int, Tensor],
    first_epoch: bool,
    totals: StepTotals,
    ranks: Ranks | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Forward and backward of one optimizer step's micro-batches (`window`), accumulating gradients.

    Every micro-batch is normalised by the whole step's token count, so the accumulated gradient is the step's
    whatever the split. With `ranks`, this process runs its share of the micro-batches, and the engine wrapping
    the model (FSDP or DDP) reduces the gradients over the processes: the same gradient as one process running
    them all. π_old of a sample is recorded in `old` on its first visit (`first_epoch`).
    """
    normaliser = float(sum(sum(samples[i].loss_mask[1:]) for mb in window for i in mb))
    # The engine averages gradients over the processes; scaled by their number, the average is the step's sum.
    scale = float(ranks.world) if ranks is not None else 1.0
    passes = my_micro_batches(window, ranks) if ranks is not None else list(window)
    for pass_indices in passes:
        if stop is not None and stop.is_set():
            raise Interrupted("training interrupted")
        # A process with no micro-batch left still runs a pass (the engine's collectives need every process),
        # weighted zero.
        indices, weight = (window[0], 0.0) if pass_indices is None else (pass_indices, scale)
        batch = collate([samples[i] for i in indices], pad_id).to(device)
        start = _first_loss_column(batch)
        logprobs = _forward_logprobs(model, batch, device, start)
        old_lp = None
        if first_epoch:
            for row, index in enumerate(indices):
                full = torch.zeros(batch.input_ids.shape[1])
                full[start:] = logprobs[row].detach().cpu()
                old[index] = full
        else:
            old_lp = _stack_old(old, indices, batch.input_ids.shape)[:, start:].to(device)
        ref = None
        if cfg.kl_coef > 0:
            with torch.no_grad(), peft_model(model).disable_adapter():
                ref = _forward_logprobs(model, batch, device, start)
        out = policy_loss(
            logprobs,
            old_lp,
            batch.behaviour_logprobs[:, start:],
            batch.advantages,
            batch.loss_mask[:, start:],
            mode=cfg.loss_mode,
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            tis_cap=cfg.tis_cap,
            ref_logprobs=ref,
            kl_coef=cfg.kl_coef,
            normaliser=normaliser,
        )
        (out.loss * weight).backward()  # type: ignore[no-untyped-call]
        if not weight:
            continue
        n = out.num_tokens
        totals.loss_tokens += n
        totals.seen_tokens += int(batch.attention_mask.sum())
        for name, value in out.metrics().items():
            if name == "loss":
                totals.sums["loss"] = totals.sums.get("loss", 0.0) + value * normaliser
            elif name != "num_tokens":
                totals.sums[name] = totals.sums.get(name, 0.0) + value * n


def run_update(
    model: Any,
    samples: Sequence[TokenizedSample],
    cfg: TrainConfig,
    *,
    pad_id: int,
    device: torch.device,
    collapse_check: CollapseCheck | None = None,
    stop: threading.Event | None = None,
    ranks: Ranks | None = None,
) -> UpdateResult:
    """Optimise the adapter on `samples`; stops early when `collapse_check` reports violated bounds.

    With `ranks` (several training processes, `trainer.distributed`), every process runs this with the same
    samples and takes its share of every step (`accumulate_step`)."""
    if not samples:
        raise ValueError("no samples to train on")
    torch.manual_seed(cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    model.train()
    result = UpdateResult()
    old: dict[int, Tensor] = {}
    totals = StepTotals()
    started = time.perf_counter()
    total_steps = math.ceil(len(samples) / (cfg.micro_batch_size * cfg.grad_accumulation)) * cfg.epochs
    lengths = [len(s.input_ids) for s in samples]
    for epoch in range(cfg.epochs):
        order = torch.randperm(len(samples), generator=generator).tolist()  # the same on every process
        for window in plan_steps(order, lengths, cfg.micro_batch_size, cfg.grad_accumulation):
            accumulate_step(
                model,
                samples,
                window,
                cfg,
                pad_id=pad_id,
                device=device,
                old=old,
                first_epoch=epoch == 0,
                totals=totals,
                ranks=ranks,
                stop=stop,
            )
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            result.steps += 1
            elapsed = time.perf_counter() - started
            logger.log(
                logging.INFO if ranks is None or ranks.main else logging.DEBUG,
                "step %d/%d  loss %.4f  grad_norm %.3f  tokens/s %.0f",
                result.steps,
                total_steps,
                totals.sums.get("loss", 0.0) / max(totals.loss_tokens, 1),
                float(grad_norm),
                totals.seen_tokens / max(elapsed, 1e-9),
            )
            every = cfg.collapse_check_every
            if (
                collapse_check is not None
                and every
                and result.steps % every == 0
                and result.steps < total_steps
            ):
                problems = collapse_check(result.steps)
                if ranks is not None:  # every process stops where rank 0's check says so
                    problems = share(problems, ranks) or []
                if problems:
                    result.stopped_early, result.problems = True, problems
                    logger.warning("stopping early at step %d: %s", result.steps, "; ".join(problems))
                    break
        if result.stopped_early:
            break
        if ranks is not None and epoch == 0 and cfg.epochs > 1:
            # Later epochs may deal a sample to another process: every process gets every π_old.
            for part in gather_objects(old, ranks):
                old.update(part)
    elapsed = time.perf_counter() - started
    if ranks is not None:
        totals = merge_totals(gather_objects(totals, ranks))
    result.metrics = {
        "steps": float(result.steps),
        "loss_tokens": float(totals.loss_tokens),
        "tokens": float(totals.seen_tokens),
        "update_s": elapsed,
        "tokens_per_s": totals.seen_tokens / max(elapsed, 1e-9),
        **{name: value / max(totals.loss_tokens, 1) for name, value in totals.sums.items()},
    }
    return result


def merge_totals(parts: Sequence[StepTotals]) -> StepTotals:
    """The processes' counts together."""
    merged = StepTotals()
    for part in parts:
        merged.loss_tokens += part.loss_tokens
        merged.seen_tokens += part.seen_tokens
        for name, value in part.sums.items():
            merged.sums[name] = merged.sums.get(name, 0.0) + value
    return merged


def peft_model(model: Any) -> Any:
    """The PEFT model inside a DDP wrapper (FSDP keeps the model's own class and methods)."""
    return getattr(model, "module", model)


def _stack_old(old: dict[int, Tensor], indices: list[int], shape: torch.Size) -> Tensor:
    out = torch.zeros(shape, dtype=torch.float32)
    for row, index in enumerate(indices):
        values = old[index][: shape[1]]
        out[row, : values.shape[0]] = values
    return out


class CollapseMonitor:
    """Samples fresh replies from the adapter under training and compares their signals with the baseline's.

    KL to the base model is estimated on the sampled reply tokens as mean(log πθ - log π_base), with the adapter
    disabled for the base pass; entropy is the policy's mean next-token entropy on those tokens.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        contexts: Sequence[tuple[list[dict[str, Any]], list[Any] | None]],
        cfg: TrainConfig,
        device: torch.device,
        bounds: CollapseBounds,
        ranks: Ranks | None = None,
    ) -> None:
        self.model = peft_model(model)
        self.tokenizer = tokenizer
        self.contexts = list(contexts)[: cfg.collapse_prompts]
        self.cfg = cfg
        self.device = device
        self.bounds = bounds
        self.ranks = ranks
        self.sampler = LocalSampler(self.model, tokenizer, device, max_new_tokens=cfg.collapse_max_new_tokens)
        # With FSDP every process takes part in every forward pass: they all sample the same replies (same seed)
        # and generate until the last of them is done.
        self.sampler.synced = ranks is not None
        self.baseline: CollapseSignals | None = None
        self.history: list[dict[str, Any]] = []

    def measure(self) -> CollapseSignals:
        if self.ranks is not None:
            torch.manual_seed(self.cfg.seed + len(self.history))
        replies: list[str] = []
        asked: list[int] = []  # the context each reply answers
        entropies: list[float] = []
        kl_sum, kl_count = 0.0, 0
        for index, samples in enumerate(self.sampler.sample_many(self.contexts, self.cfg.collapse_samples)):
            replies.extend(s.text for s in samples)
            asked.extend([index] * len(samples))
            rows = [
                TokenizedSample(
                    s.prompt_token_ids + s.token_ids,
                    [False] * len(s.prompt_token_ids) + [True] * len(s.token_ids),
                    [None] * (len(s.prompt_token_ids) + len(s.token_ids)),
                    0.0,
                )
                for s in samples
                if s.token_ids
            ]
            if not rows:
                continue
            batch = collate(rows, int(self.tokenizer.pad_token_id)).to(self.device)
            was_training = self.model.training
            self.model.eval()
            try:
                with torch.no_grad():
                    with autocast(self.device):
                        logits = self.model(
                            input_ids=batch.input_ids, attention_mask=batch.attention_mask
                        ).logits
                    policy_lp = token_logprobs(logits, batch.targets)
                    entropy = token_entropy(logits)
                    with self.model.disable_adapter():
                        base_lp = _forward_logprobs(self.model, batch, self.device)
            finally:
                self.model.train(was_training)
            mask = batch.loss_mask
            entropies.extend(float(v) for v in entropy[mask])
            kl_sum += float((policy_lp - base_lp)[mask].sum())
            kl_count += int(mask.sum())
        return measure(replies, entropies, kl_sum / kl_count if kl_count else None, contexts=asked)

    def start(self) -> CollapseSignals:
        """Measure the active adapter before any update: the baseline ratios are taken against."""
        self.baseline = self.measure()
        self.history.append({"step": 0, **self.baseline.__dict__})
        return self.baseline

    def __call__(self, step: int) -> list[str]:
        signals = self.measure()
        self.history.append({"step": step, **signals.__dict__})
        problems = check(signals, self.bounds, self.baseline)
        logger.info(
            "collapse check at step %d: distinct %.2f empty %.2f length %.0f entropy %s kl %s%s",
            step,
            signals.distinct_share,
            signals.empty_share,
            signals.mean_length,
            _fmt(signals.mean_entropy),
            _fmt(signals.kl_to_base),
            f"  VIOLATED: {problems}" if problems else "",
        )
        return problems


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"
