"""The training losses as pure functions: the GRPO policy loss for off-policy production data, and the SFT
loss (`sft_loss`) that imitates demonstrations.

Notation (per assistant token t of trajectory b):

* ``logπθ``  - log-probability under the policy being optimised (carries the gradient);
* ``logπ_old`` - the same policy at the start of this update. With one optimisation step per
  batch it equals ``logπθ.detach()`` and the ratio below is exactly 1 in value;
* ``logμ``   - the behaviour policy that actually sampled the token, captured by the engine at
  sampling time. Production traffic is served by older adapter versions (and by vLLM, whose
  numerics differ from the trainer's), so μ ≠ π_old in general;
* ``A``      - the trajectory's group-relative advantage (see ``trainer.learner.advantages``).

Unknown behaviour logprobs (upstream engines that return none, resampled tokens whose logprobs
were not kept) are marked with NaN in ``behaviour_logprobs``. NaN was chosen over a separate mask
because the collated batch then carries one tensor instead of two that must stay aligned, and a
NaN that leaked into arithmetic would be loud rather than silently treated as a real value. Such
tokens get importance weight 1, i.e. they are treated as on-policy.
"""

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from trainer.control.policy_config import CLIP_HIGH, CLIP_LOW, KL_COEF, TIS_CAP

LossMode = Literal["ppo", "cispo"]


@dataclass(frozen=True)
class LossOutput:
    """The scalar loss to back-propagate, plus detached per-batch metrics over masked tokens."""

    loss: Tensor
    #: Share of loss tokens whose ratio r lies outside [1-ε_low, 1+ε_high] (mode independent).
    clip_fraction: Tensor
    mean_ratio: Tensor
    #: Mean truncated importance weight w; far from 1 means the data is strongly off-policy.
    mean_importance_weight: Tensor
    #: Share of loss tokens whose importance weight hit the cap.
    truncated_fraction: Tensor
    #: Mean k3 estimate of KL(πθ || π_ref) per token; None when no reference logprobs were given.
    mean_kl: Tensor | None
    num_tokens: int

    def metrics(self) -> dict[str, float]:
        """Plain floats for logging and the ``training_runs`` row."""
        out = {
            "loss": float(self.loss.detach()),
            "clip_fraction": float(self.clip_fraction),
            "mean_ratio": float(self.mean_ratio),
            "mean_importance_weight": float(self.mean_importance_weight),
            "truncated_fraction": float(self.truncated_fraction),
            "num_tokens": float(self.num_tokens),
        }
        if self.mean_kl is not None:
            out["mean_kl"] = float(self.mean_kl)
        return out


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor | None,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    mode: LossMode,
    clip_low: float = CLIP_LOW,
    clip_high: float = CLIP_HIGH,
    tis_cap: float = TIS_CAP,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = KL_COEF,
    normaliser: float | None = None,
) -> LossOutput:
    """Clipped, importance-weighted policy-gradient loss, averaged over loss tokens.

    Shapes: ``logprobs``, ``old_logprobs``, ``behaviour_logprobs``, ``ref_logprobs`` and ``mask``
    are [B, T] (``mask`` is True on assistant tokens that carry loss); ``advantages`` is [B].
    ``old_logprobs=None`` means one optimisation step per batch (π_old = πθ.detach()).

    Modes:

    * ``ppo``: per token ``-w · min(r·A, clip(r, 1-ε_low, 1+ε_high)·A)``. Tokens whose ratio has
      already moved past the clip in the direction A favours get no gradient.
    * ``cispo`` (MiniMax-M1): per token ``-w · sg(clip(r, 1-ε_low, 1+ε_high)) · A · logπθ``. The
      clip bounds only the (stopped) weight, so every token keeps a REINFORCE gradient; rare
      "fork" tokens, which PPO clipping tends to drop, still learn.

    Aggregation is a token-level mean over every loss token in the batch (DAPO): each token
    counts once, so long replies are not down-weighted token-by-token the way a per-sequence mean
    does, and a long bad reply is penalised in proportion to its length. When a batch is split
    into micro-batches for gradient accumulation, pass the whole batch's token count as
    ``normaliser`` so the accumulated gradient equals the full-batch one.
    """
    if mode not in ("ppo", "cispo"):
        raise ValueError(f"unknown loss mode {mode!r}; expected 'ppo' or 'cispo'")
    shape = logprobs.shape
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got {tuple(shape)}")
    for name, tensor in (
        ("old_logprobs", old_logprobs),
        ("behaviour_logprobs", behaviour_logprobs),
        ("mask", mask),
        ("ref_logprobs", ref_logprobs),
    ):
        if tensor is not None and tensor.shape != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
    if advantages.shape != shape[:1]:
        raise ValueError(f"advantages must be [B]={shape[0]}, got {tuple(advantages.shape)}")
    if kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError("kl_coef is non-zero but no ref_logprobs were given")

    mask = mask.bool()
    logprobs = logprobs.float()
    # logπ_old: fixed during the update, never differentiated.
    old = (logprobs if old_logprobs is None else old_logprobs.float()).detach()
    # A broadcast over the trajectory's tokens: [B] -> [B, 1].
    adv = advantages.float().detach().unsqueeze(-1)

    # r = exp(logπθ - logπ_old)
    ratio = torch.exp(logprobs - old)
    # w = min(exp(logπ_old - logμ), C), detached; unknown μ (NaN) -> logμ := logπ_old -> w = 1.
    behaviour = behaviour_logprobs.float().detach()
    behaviour = torch.where(torch.isnan(behaviour), old, behaviour)
    raw_weight = torch.exp(old - behaviour)
    weight = raw_weight.clamp(max=tis_cap)
    # clip(r, 1-ε_low, 1+ε_high)
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)

    if mode == "ppo":
        # -w · min(r·A, clip(r)·A)
        per_token = -weight * torch.minimum(ratio * adv, clipped_ratio * adv)
    else:
        # -w · sg(clip(r)) · A · logπθ: the gradient flows through logπθ only.
        per_token = -weight * clipped_ratio.detach() * adv * logprobs

    kl: Tensor | None = None
    if ref_logprobs is not None:
        # k3 estimator of KL(πθ || π_ref): exp(d) - d - 1 with d = logπ_ref - logπθ (≥ 0, unbiased).
        delta = ref_logprobs.float().detach() - logprobs
        kl = torch.exp(delta) - delta - 1.0
        if kl_coef != 0.0:
            per_token = per_token + kl_coef * kl

    # Token-level mean over all loss tokens of the batch (where() keeps padding garbage out).
    count = int(mask.sum())
    denominator = float(normaliser) if normaliser is not None else float(max(count, 1))
    loss = torch.where(mask, per_token, torch.zeros_like(per_token)).sum() / denominator

    with torch.no_grad():
        n = max(count, 1)

        def masked_mean(values: Tensor) -> Tensor:
            return torch.where(mask, values, torch.zeros_like(values)).sum() / n

        outside = ((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)).float()
        return LossOutput(
            loss=loss,
            clip_fraction=masked_mean(outside),
            mean_ratio=masked_mean(ratio),
            mean_importance_weight=masked_mean(weight),
            truncated_fraction=masked_mean((raw_weight > tis_cap).float()),
            mean_kl=None if kl is None else masked_mean(kl),
            num_tokens=count,
        )


@dataclass(frozen=True)
class SFTLossOutput:
    """The scalar loss to back-propagate, plus the detached mean NLL per masked token."""

    loss: Tensor
    #: Mean negative log-likelihood (nats) per loss token; exp() of it is the demonstrations' perplexity.
    mean_nll: Tensor
    num_tokens: int


def sft_loss(
    logprobs: Tensor, mask: Tensor, *, weight: float = 1.0, normaliser: float | None = None
) -> SFTLossOutput:
    """Supervised fine-tuning loss: token-level negative log-likelihood of demonstration tokens.

    Shapes: ``logprobs`` and ``mask`` are [B, T] (``mask`` is True on the assistant tokens to imitate).
    Per token ``-weight · logπθ``, summed over masked tokens and divided by their count, or by
    ``normaliser`` when a step is split into micro-batches (as in ``policy_loss``, so that demonstrations
    and policy-gradient tokens of one step share one token-level mean). ``weight`` scales the term where it
    is mixed into a GRPO step; the reported ``mean_nll`` does not include it.
    """
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got {tuple(logprobs.shape)}")
    if mask.shape != logprobs.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {tuple(logprobs.shape)}")
    if not weight >= 0.0:
        raise ValueError(f"weight must be non-negative, got {weight!r}")
    mask = mask.bool()
    nll = -logprobs.float()
    count = int(mask.sum())
    denominator = float(normaliser) if normaliser is not None else float(max(count, 1))
    # where(): padding positions may hold anything (even -inf logprobs); they must not reach the sum.
    total = torch.where(mask, nll, torch.zeros_like(nll)).sum()
    with torch.no_grad():
        mean_nll = total.detach() / max(count, 1)
    return SFTLossOutput(loss=weight * total / denominator, mean_nll=mean_nll, num_tokens=count)
