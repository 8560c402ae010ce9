"""Token tensors for the trainer: collation of captured trajectories and per-token log-probabilities.

Trajectories are built from the token ids the engine actually sampled (no re-tokenisation), so the
behaviour logprobs captured at sampling time stay aligned with the tokens they describe.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

#: Rows of the flattened [B*T, V] logits handled at once in float32. At a 150k vocabulary this is
#: ~600 MB of float32 scratch, instead of B*T times that for a full float32 log-softmax.
DEFAULT_CHUNK_ROWS = 1024


@dataclass(frozen=True)
class TokenizedSample:
    """One trajectory as the trainer sees it; all per-token lists are aligned with ``input_ids``."""

    input_ids: list[int]
    #: True only on assistant tokens that were sampled by the policy (they carry the loss).
    loss_mask: list[bool]
    #: Behaviour-policy logprob of each token at sampling time; None where unknown or not assistant.
    behaviour_logprobs: list[float | None]
    advantage: float
    #: A demonstration to imitate (SFT loss) rather than an attempt to weigh by its advantage (policy loss).
    demonstration: bool = False

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        if n < 2:
            raise ValueError("a sample needs at least two tokens to predict anything")
        if len(self.loss_mask) != n or len(self.behaviour_logprobs) != n:
            raise ValueError(
                f"per-token lists must align with input_ids ({n}): loss_mask has {len(self.loss_mask)}, "
                f"behaviour_logprobs has {len(self.behaviour_logprobs)}"
            )
        if not math.isfinite(self.advantage):
            raise ValueError(f"advantage must be finite, got {self.advantage!r}")


@dataclass(frozen=True)
class Batch:
    """Right-padded tensors, already shifted for next-token prediction.

    Position j of ``input_ids`` predicts ``targets[:, j]`` (the original token j+1); ``loss_mask``
    and ``behaviour_logprobs`` describe the target token. Unknown behaviour logprobs are NaN,
    which ``trainer.learner.loss.policy_loss`` reads as importance weight 1.
    """

    input_ids: Tensor  # [B, T] long
    attention_mask: Tensor  # [B, T] long, 1 on real tokens
    targets: Tensor  # [B, T] long
    loss_mask: Tensor  # [B, T] bool
    behaviour_logprobs: Tensor  # [B, T] float32, NaN where unknown
    advantages: Tensor  # [B] float32
    demonstrations: Tensor  # [B] bool, True for rows trained with the SFT loss

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            targets=self.targets.to(device),
            loss_mask=self.loss_mask.to(device),
            behaviour_logprobs=self.behaviour_logprobs.to(device),
            advantages=self.advantages.to(device),
            demonstrations=self.demonstrations.to(device),
        )


def collate(samples: Sequence[TokenizedSample], pad_id: int) -> Batch:
    """Pad samples on the right and shift them: inputs are ``ids[:-1]``, targets are ``ids[1:]``.

    The first token of a sample is never a target (nothing precedes it), so its mask is dropped.
    Padding positions have attention 0, loss mask False and NaN behaviour logprob.
    """
    if not samples:
        raise ValueError("cannot collate an empty batch")
    width = max(len(s.input_ids) for s in samples) - 1
    rows = len(samples)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    targets = torch.full((rows, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((rows, width), dtype=torch.long)
    loss_mask = torch.zeros((rows, width), dtype=torch.bool)
    behaviour = torch.full((rows, width), math.nan, dtype=torch.float32)
    for row, sample in enumerate(samples):
        length = len(sample.input_ids) - 1
        ids = torch.tensor(sample.input_ids, dtype=torch.long)
        input_ids[row, :length] = ids[:-1]
        targets[row, :length] = ids[1:]
        attention_mask[row, :length] = 1
        loss_mask[row, :length] = torch.tensor(sample.loss_mask[1:], dtype=torch.bool)
        behaviour[row, :length] = torch.tensor(
            [math.nan if lp is None else lp for lp in sample.behaviour_logprobs[1:]], dtype=torch.float32
        )
    # Behaviour logprobs outside the loss are meaningless to the loss; keep them NaN.
    behaviour = torch.where(loss_mask, behaviour, torch.full_like(behaviour, math.nan))
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    demonstrations = torch.tensor([s.demonstration for s in samples], dtype=torch.bool)
    return Batch(input_ids, attention_mask, targets, loss_mask, behaviour, advantages, demonstrations)


class _TargetLogprob(torch.autograd.Function):
    """log softmax(logits)[target] without a full-vocabulary float32 log-softmax.

    Forward keeps only the per-row logsumexp; backward recomputes softmax chunk by chunk. Autograd
    through ``logsumexp`` would instead save a float32 copy of every chunk for the backward pass.
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, chunk_rows: int) -> Tensor:
        rows = logits.shape[0]
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
        for start in range(0, rows, chunk_rows):
            stop = start + chunk_rows
            lse[start:stop] = torch.logsumexp(logits[start:stop].float(), dim=-1)
        picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1).float()
        ctx.save_for_backward(logits, targets, lse)
        ctx.chunk_rows = chunk_rows
        return picked - lse

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None, None]:
        logits, targets, lse = ctx.saved_tensors
        chunk_rows: int = ctx.chunk_rows
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], chunk_rows):
            stop = start + chunk_rows
            grad = grad_out[start:stop].float().unsqueeze(-1)
            # d(logit_t - lse)/d logit_v = 1[v = t] - softmax_v
            chunk = -torch.exp(logits[start:stop].float() - lse[start:stop].unsqueeze(-1)) * grad
            chunk.scatter_add_(-1, targets[start:stop].unsqueeze(-1), grad)
            grad_logits[start:stop] = chunk.to(logits.dtype)
        return grad_logits, None, None


def token_logprobs(logits: Tensor, targets: Tensor, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> Tensor:
    """Per-token log-probability of ``targets`` under ``logits``: [B, T, V], [B, T] -> [B, T] float32.

    Computed as ``logit[target] - logsumexp(logits)`` in float32, ``chunk_rows`` rows at a time, in
    both the forward and the backward pass, so bf16 logits never need a full float32 copy.
    """
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(f"expected logits [B, T, V] and targets [B, T], got {logits.shape}, {targets.shape}")
    if chunk_rows < 1:
        raise ValueError("chunk_rows must be positive")
    batch, steps, vocab = logits.shape
    # torch leaves Function.apply unannotated; the forward above fixes the return type.
    flat: Tensor = _TargetLogprob.apply(  # type: ignore[no-untyped-call]
        logits.reshape(batch * steps, vocab), targets.reshape(-1), chunk_rows
    )
    return flat.reshape(batch, steps)


@torch.no_grad()
def token_entropy(logits: Tensor, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> Tensor:
    """Entropy (nats) of each position's next-token distribution: [B, T, V] -> [B, T] float32.

    A monitoring signal (collapse shows up as entropy falling towards 0), so it is not
    differentiable. ``H = -Σ p·log p``, chunked like ``token_logprobs``.
    """
    if logits.dim() != 3:
        raise ValueError(f"expected logits [B, T, V], got {logits.shape}")
    batch, steps, vocab = logits.shape
    flat = logits.reshape(batch * steps, vocab)
    out = torch.empty(batch * steps, dtype=torch.float32, device=logits.device)
    for start in range(0, flat.shape[0], chunk_rows):
        chunk = flat[start : start + chunk_rows].float()
        logp = chunk - torch.logsumexp(chunk, dim=-1, keepdim=True)
        probs = torch.exp(logp)
        # where(): tokens masked to -inf logits have p = 0 and contribute 0, not 0·(-inf) = NaN.
        out[start : start + chunk_rows] = -torch.where(probs > 0, probs * logp, 0.0).sum(-1)
    return out.reshape(batch, steps)
