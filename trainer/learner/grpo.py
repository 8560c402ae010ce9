"""The GRPO update: micro-batched forward/backward of ``trainer.learner.loss.policy_loss`` with gradient accumulation,
progress logging, and collapse checks that stop the run early. Demonstration samples (``demonstration=True``)
are trained with ``trainer.learner.loss.sft_loss`` in the same loop, alone (an SFT run or phase) or mixed into GRPO
steps.

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

from trainer.control.collapse import (
    CollapseBounds,
    CollapseSignals,
    backed_by_reward,
    check,
    measure,
    movement_problems,
)
from trainer.control.launch import Ranks
from trainer.control.policy_config import TrainConfig
from trainer.learner.batch import Batch, TokenizedSample, collate, token_entropy, token_logprobs
from trainer.learner.distributed import gather_objects, my_micro_batches, share
from trainer.learner.loss import policy_loss, sft_loss
from trainer.learner.model import LocalSampler, autocast

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
    #: One entry per optimizer step: its loss and gradient norm (the dashboard draws them).
    history: list[dict[str, float]] = field(default_factory=list)


def _forward_logprobs(model: Any, batch: Batch, device: torch.device, start: int = 0) -> Tensor:
    """Logprobs of ``batch.targets[:, start:]``; logits are computed only from column `start` on.

    The vocabulary projection is a large share of a small model's compute, and prompt positions carry no loss.
    No key/value cache: nothing is generated after the pass (and a compiled layer would compile again for each
    layer's cache entry).
    """
    with autocast(device):
        logits = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            logits_to_keep=batch.input_ids.shape[1] - start,
            use_cache=False,
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


def planned_passes(samples: int, cfg: TrainConfig) -> int:
    """The forward and backward passes `run_update` makes over `samples` samples (`plan_steps`' micro-batches)."""
    per_step = cfg.micro_batch_size * cfg.grad_accumulation
    full, rest = divmod(samples, per_step)
    return (full * cfg.grad_accumulation + math.ceil(rest / cfg.micro_batch_size)) * cfg.epochs


@dataclass
class StepTotals:
    """What the passes of an update counted on this process: tokens, and metric sums weighted by tokens."""

    loss_tokens: int = 0
    seen_tokens: int = 0
    sums: dict[str, float] = field(default_factory=dict)
    sft_tokens: int = 0  # demonstration tokens, and the sum of their negative log-likelihoods
    sft_nll: float = 0.0


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
    sft_weight: float = 1.0,
    ranks: Ranks | None = None,
    stop: threading.Event | None = None,
) -> float:
    """Forward and backward of one optimizer step's micro-batches (`window`), accumulating gradients.

    Every micro-batch is normalised by the whole step's token count, so the accumulated gradient is the step's
    whatever the split. With `ranks`, this process runs its share of the micro-batches, and the engine wrapping
    the model (FSDP or DDP) reduces the gradients over the processes: the same gradient as one process running
    them all. π_old of a sample is recorded in `old` on its first visit (`first_epoch`). Demonstration samples
    take the SFT loss (times `sft_weight`) instead of the policy loss. Returns this process's part of the step's
    policy loss.
    """
    normaliser = float(sum(sum(samples[i].loss_mask[1:]) for mb in window for i in mb))
    # The engine averages gradients over the processes; scaled by their number, the average is the step's sum.
    scale = float(ranks.world) if ranks is not None else 1.0
    passes = my_micro_batches(window, ranks) if ranks is not None else list(window)
    step_loss = 0.0
    for pass_indices in passes:
        if stop is not None and stop.is_set():
            raise Interrupted("training interrupted")
        # A process with no micro-batch left still runs a pass (the engine's collectives need every process),
        # weighted zero.
        indices, weight = (window[0], 0.0) if pass_indices is None else (pass_indices, scale)
        # What the host can count, it counts before the batch goes to the device: on a GPU each value read
        # back waits for every kernel queued before it.
        host = collate([samples[i] for i in indices], pad_id)
        start = _first_loss_column(host)
        imitating = bool(host.demonstrations.any())
        seen = int(host.attention_mask.sum())
        batch = host.to(device)
        logprobs = _forward_logprobs(model, batch, device, start)
        old_lp = None
        if first_epoch:
            visited = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
            visited[:, start:] = logprobs.detach().cpu()  # one copy back for the micro-batch
            for row, index in enumerate(indices):
                old[index] = visited[row]
        else:
            old_lp = _stack_old(old, indices, batch.input_ids.shape)[:, start:].to(device)
        ref = None
        if cfg.kl_coef > 0:
            with torch.no_grad(), peft_model(model).disable_adapter():
                ref = _forward_logprobs(model, batch, device, start)
        mask = batch.loss_mask[:, start:]
        imitate = batch.demonstrations.unsqueeze(-1)
        out = policy_loss(
            logprobs,
            old_lp,
            batch.behaviour_logprobs[:, start:],
            batch.advantages,
            mask & ~imitate,
            mode=cfg.loss_mode,
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            tis_cap=cfg.tis_cap,
            ref_logprobs=ref,
            kl_coef=cfg.kl_coef,
            normaliser=normaliser,
        )
        loss = out.loss
        sft = None
        if imitating:
            sft = sft_loss(logprobs, mask & imitate, weight=sft_weight, normaliser=normaliser)
            loss = loss + sft.loss
        (loss * weight).backward()  # type: ignore[no-untyped-call]
        if not weight:
            continue
        if sft is not None:
            totals.sft_tokens += sft.num_tokens
            totals.sft_nll += float(sft.mean_nll) * sft.num_tokens
        n = out.num_tokens
        totals.loss_tokens += n
        totals.seen_tokens += seen
        for name, value in out.metrics().items() if n else ():
            if name == "loss":
                totals.sums["loss"] = totals.sums.get("loss", 0.0) + value * normaliser
                step_loss += value  # each micro-batch's loss is already over the step's tokens
            elif name != "num_tokens":
                totals.sums[name] = totals.sums.get(name, 0.0) + value * n
    return step_loss


def run_update(
    model: Any,
    samples: Sequence[TokenizedSample],
    cfg: TrainConfig,
    *,
    pad_id: int,
    device: torch.device,
    collapse_check: CollapseCheck | None = None,
    stop: threading.Event | None = None,
    sft_weight: float = 1.0,
    ranks: Ranks | None = None,
) -> UpdateResult:
    """Optimise the adapter on `samples`; stops early when `collapse_check` reports violated bounds.

    Demonstration samples carry the SFT loss times `sft_weight`; the others the policy loss. Both share one
    token-level mean per optimizer step. With `ranks` (several training processes, `trainer.learner.distributed`), every
    process runs this with the same samples and takes its share of every step (`accumulate_step`)."""
    if not samples:
        raise ValueError("no samples to train on")
    torch.manual_seed(cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    # On a GPU, one fused kernel updates every LoRA tensor instead of a few launches per group of them; elsewhere
    # torch picks its own implementation (None), as it does by default.
    fused = True if device.type == "cuda" else None
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, fused=fused)
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
            step_loss = accumulate_step(
                model,
                samples,
                window,
                cfg,
                pad_id=pad_id,
                device=device,
                old=old,
                first_epoch=epoch == 0,
                totals=totals,
                sft_weight=sft_weight,
                ranks=ranks,
                stop=stop,
            )
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            result.steps += 1
            result.history.append({"step": result.steps, "loss": step_loss, "grad_norm": float(grad_norm)})
            elapsed = time.perf_counter() - started
            logger.log(
                logging.INFO if ranks is None or ranks.main else logging.DEBUG,
                "step %d/%d %s%s  grad_norm %.3f  tokens/s %.0f",
                result.steps,
                total_steps,
                f" loss {totals.sums.get('loss', 0.0) / totals.loss_tokens:.4f}"
                if totals.loss_tokens
                else "",
                f"  sft_nll {totals.sft_nll / totals.sft_tokens:.4f}" if totals.sft_tokens else "",
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
    if totals.sft_tokens:
        result.metrics.update(sft_tokens=float(totals.sft_tokens), sft_nll=totals.sft_nll / totals.sft_tokens)
    return result


def merge_totals(parts: Sequence[StepTotals]) -> StepTotals:
    """The processes' counts together."""
    merged = StepTotals()
    for part in parts:
        merged.loss_tokens += part.loss_tokens
        merged.seen_tokens += part.seen_tokens
        merged.sft_tokens += part.sft_tokens
        merged.sft_nll += part.sft_nll
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


#: Scores replies to the monitor's i-th context with the policy's scorer; None where a reply went unscored.
ScoreReplies = Callable[[int, list[str]], list[float | None]]


class CollapseMonitor:
    """Samples fresh replies from the adapter under training and compares their signals with the baseline's.

    KL is estimated on the sampled reply tokens as mean(log πθ - log π_ref): to the base model with the adapter
    disabled, and to the version the run started from with its LoRA weights swapped back in for one pass;
    entropy is the policy's mean next-token entropy on those tokens. With `score`, the replies are also scored
    by the policy's scorer, the reward evidence that lets a policy move far where the reward asks it to.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        contexts: Sequence[tuple[list[dict[str, Any]], list[Any] | None]],
        cfg: TrainConfig,
        device: torch.device,
        bounds: CollapseBounds,
        score: ScoreReplies | None = None,
        ranks: Ranks | None = None,
    ) -> None:
        self.model = peft_model(model)
        self.tokenizer = tokenizer
        self.contexts = list(contexts)[: cfg.collapse_prompts]
        self.cfg = cfg
        self.device = device
        self.bounds = bounds
        self.score = score
        self.ranks = ranks
        self.sampler = LocalSampler(self.model, tokenizer, device, max_new_tokens=cfg.collapse_max_new_tokens)
        # With FSDP every process takes part in every forward pass: they all sample the same replies (same seed)
        # and generate until the last of them is done.
        self.sampler.synced = ranks is not None
        self.baseline: CollapseSignals | None = None
        self.history: list[dict[str, Any]] = []
        self._trainable = [p for p in model.parameters() if p.requires_grad]
        self._start: list[Tensor] | None = None

    def _logprobs_at_start(self, batches: list[Batch]) -> list[Tensor]:
        """Logprobs under the weights the run started from: swapped in for one pass, then restored exactly."""
        assert self._start is not None
        current = [p.detach().clone() for p in self._trainable]
        with torch.no_grad():
            for param, start in zip(self._trainable, self._start, strict=True):
                param.copy_(start)
            try:
                return [_forward_logprobs(self.model, batch, self.device) for batch in batches]
            finally:
                for param, value in zip(self._trainable, current, strict=True):
                    param.copy_(value)

    def measure(self) -> CollapseSignals:
        if self.ranks is not None:
            torch.manual_seed(self.cfg.seed + len(self.history))
        replies: list[str] = []
        asked: list[int] = []  # the context each reply answers
        rewards: list[float] = []
        entropies: list[float] = []
        batches: list[Batch] = []
        policy_lps: list[Tensor] = []
        base_kl, start_kl, count = 0.0, 0.0, 0
        for index, samples in enumerate(self.sampler.sample_many(self.contexts, self.cfg.collapse_samples)):
            texts = [s.text for s in samples]
            replies.extend(texts)
            asked.extend([index] * len(samples))
            if self.score is not None and texts:
                rewards.extend(r for r in self.score(index, texts) if r is not None)
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
            base_kl += float((policy_lp - base_lp)[mask].sum())
            count += int(mask.sum())
            batches.append(batch)
            policy_lps.append(policy_lp)
        if self._start is not None and batches:
            was_training = self.model.training
            self.model.eval()
            try:
                start_lps = self._logprobs_at_start(batches)
            finally:
                self.model.train(was_training)
            for batch, policy_lp, start_lp in zip(batches, policy_lps, start_lps, strict=True):
                start_kl += float((policy_lp - start_lp)[batch.loss_mask].sum())
        return measure(
            replies,
            entropies,
            base_kl / count if count else None,
            contexts=asked,
            kl_to_start=(start_kl / count if count else None) if self._start is not None else 0.0,
            rewards=rewards,
        )

    def start(self) -> CollapseSignals:
        """Measure the active adapter before any update: the baseline ratios are taken against."""
        self.baseline = self.measure()
        self._start = [p.detach().clone() for p in self._trainable]
        self.history.append({"step": 0, **self.baseline.__dict__})
        return self.baseline

    def __call__(self, step: int) -> list[str]:
        signals = self.measure()
        problems = check(signals, self.bounds, self.baseline)
        waived = (
            movement_problems(signals, self.bounds, self.baseline)
            if backed_by_reward(signals, self.bounds, self.baseline)
            else []
        )
        self.history.append({"step": step, **signals.__dict__, "waived": waived})
        logger.info(
            "collapse check at step %d: distinct %.2f empty %.2f length %.0f entropy %s kl_base %s kl_start %s "
            "reward %s (baseline %s)%s%s",
            step,
            signals.distinct_share,
            signals.empty_share,
            signals.mean_length,
            _fmt(signals.mean_entropy),
            _fmt(signals.kl_to_base),
            _fmt(signals.kl_to_start),
            _fmt(signals.reward),
            _fmt(self.baseline.reward if self.baseline else None),
            f"  WAIVED (the reward rose): {waived}" if waived else "",
            f"  VIOLATED: {problems}" if problems else "",
        )
        return problems


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"
