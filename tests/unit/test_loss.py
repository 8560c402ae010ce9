import math

import pytest
import torch
from torch import Tensor, nn

from trainer.control.policy_config import CLIP_HIGH, CLIP_LOW, KL_COEF, TIS_CAP
from trainer.learner.batch import TokenizedSample, collate, token_logprobs
from trainer.learner.loss import LossMode, policy_loss, sft_loss

# Hand-made batch: B=2 trajectories, T=3 tokens, ε_low=0.2, ε_high=0.28, C=2.
# logπθ is built as logπ_old + ln r so every ratio r is a round number.
OLD = [[-1.0, -2.0, -0.5], [-1.5, -1.0, -3.0]]
RATIO = [[1.5, 0.7, 1.0], [0.5, 1.1, 1.2]]
# Untruncated importance weights π_old/μ; None = behaviour logprob unknown. Token [1][2] is masked
# out and given an absurd weight to show it cannot leak into the loss.
WEIGHT = [[1.0, None, 3.0], [0.8, 1.25, 9.0e6]]
MASK = [[True, True, True], [True, True, False]]
ADV = [2.0, -1.0]
N_TOKENS = 5


def _inputs() -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    old = torch.tensor(OLD, dtype=torch.float64)
    logprobs = (old + torch.tensor(RATIO, dtype=torch.float64).log()).float().requires_grad_()
    behaviour = torch.tensor(
        [
            [math.nan if w is None else o - math.log(w) for o, w in zip(orow, wrow, strict=True)]
            for orow, wrow in zip(OLD, WEIGHT, strict=True)
        ]
    )
    return logprobs, old.float(), behaviour, torch.tensor(ADV), torch.tensor(MASK)


def test_defaults_are_the_documented_values() -> None:
    assert (CLIP_LOW, CLIP_HIGH, TIS_CAP, KL_COEF) == (0.2, 0.28, 2.0, 0.0)


def test_ppo_loss_by_hand() -> None:
    logprobs, old, behaviour, adv, mask = _inputs()
    out = policy_loss(logprobs, old, behaviour, adv, mask, mode="ppo")
    # per token: -w · min(r·A, clip(r, 0.8, 1.28)·A)
    expected = [
        -1.0 * min(1.5 * 2.0, 1.28 * 2.0),  # = -2.56, upper clip active
        -1.0 * min(0.7 * 2.0, 0.8 * 2.0),  # = -1.40, unknown μ -> w=1; r<0.8 but A>0 keeps r·A
        -2.0 * min(1.0 * 2.0, 1.0 * 2.0),  # = -4.00, w=3 truncated to 2
        -0.8 * min(0.5 * -1.0, 0.8 * -1.0),  # = +0.64, lower clip active (A<0)
        -1.25 * min(1.1 * -1.0, 1.1 * -1.0),  # = +1.375
    ]
    assert sum(expected) / N_TOKENS == pytest.approx(-1.189)
    assert out.loss.item() == pytest.approx(-1.189, abs=1e-6)
    assert out.num_tokens == N_TOKENS
    # r outside [0.8, 1.28]: 1.5, 0.7, 0.5 -> 3 of 5
    assert out.clip_fraction.item() == pytest.approx(0.6)
    assert out.mean_ratio.item() == pytest.approx((1.5 + 0.7 + 1.0 + 0.5 + 1.1) / 5)
    assert out.mean_importance_weight.item() == pytest.approx((1.0 + 1.0 + 2.0 + 0.8 + 1.25) / 5)
    assert out.truncated_fraction.item() == pytest.approx(0.2)
    assert out.mean_kl is None
    metrics = out.metrics()
    assert metrics["loss"] == pytest.approx(-1.189, abs=1e-6)
    assert "mean_kl" not in metrics
    assert not out.clip_fraction.requires_grad


def test_cispo_loss_by_hand() -> None:
    logprobs, old, behaviour, adv, mask = _inputs()
    out = policy_loss(logprobs, old, behaviour, adv, mask, mode="cispo")
    # per token: -w · clip(r, 0.8, 1.28) · A · logπθ, with logπθ = logπ_old + ln r
    expected = [
        -1.0 * 1.28 * 2.0 * (-1.0 + math.log(1.5)),  # = 1.522009
        -1.0 * 0.80 * 2.0 * (-2.0 + math.log(0.7)),  # = 3.770680
        -2.0 * 1.00 * 2.0 * (-0.5 + math.log(1.0)),  # = 2.000000
        -0.8 * 0.80 * -1.0 * (-1.5 + math.log(0.5)),  # = -1.403614
        -1.25 * 1.10 * -1.0 * (-1.0 + math.log(1.1)),  # = -1.243949
    ]
    assert sum(expected) / N_TOKENS == pytest.approx(0.929025, abs=1e-6)
    assert out.loss.item() == pytest.approx(0.929025, abs=1e-5)
    assert out.clip_fraction.item() == pytest.approx(0.6)


def test_cispo_gradient_is_minus_w_clipped_ratio_advantage_over_n() -> None:
    logprobs, old, behaviour, adv, mask = _inputs()
    policy_loss(logprobs, old, behaviour, adv, mask, mode="cispo").loss.backward()
    assert logprobs.grad is not None
    expected = (
        torch.tensor(
            [
                [-1.0 * 1.28 * 2.0, -1.0 * 0.8 * 2.0, -2.0 * 1.0 * 2.0],
                [-0.8 * 0.8 * -1.0, -1.25 * 1.1 * -1.0, 0.0],  # masked token: no gradient
            ]
        )
        / N_TOKENS
    )
    torch.testing.assert_close(logprobs.grad, expected)


def test_ppo_gradient_vanishes_where_the_clip_is_active() -> None:
    logprobs, old, behaviour, adv, mask = _inputs()
    policy_loss(logprobs, old, behaviour, adv, mask, mode="ppo").loss.backward()
    assert logprobs.grad is not None
    # d/dlogπ of -w·r·A is -w·r·A where unclipped; 0 on clipped tokens and masked ones
    expected = (
        torch.tensor(
            [
                [0.0, -1.0 * 0.7 * 2.0, -2.0 * 1.0 * 2.0],
                [0.0, -1.25 * 1.1 * -1.0, 0.0],
            ]
        )
        / N_TOKENS
    )
    torch.testing.assert_close(logprobs.grad, expected)


def test_kl_penalty_by_hand() -> None:
    logprobs, old, behaviour, adv, mask = _inputs()
    # d = logπ_ref - logπθ per token; the masked token gets a huge d that must not count
    delta = [[0.1, -0.2, 0.0], [0.3, -0.1, 5.0]]
    ref = logprobs.detach() + torch.tensor(delta)
    out = policy_loss(logprobs, old, behaviour, adv, mask, mode="ppo", ref_logprobs=ref, kl_coef=0.1)
    k3 = [math.exp(d) - d - 1 for d in (0.1, -0.2, 0.0, 0.3, -0.1)]
    # = 0.005171, 0.018731, 0, 0.049859, 0.004837
    mean_kl = sum(k3) / N_TOKENS
    assert out.mean_kl is not None
    assert out.mean_kl.item() == pytest.approx(mean_kl, rel=1e-5)
    assert out.loss.item() == pytest.approx(-1.189 + 0.1 * mean_kl, abs=1e-6)
    assert out.metrics()["mean_kl"] == pytest.approx(mean_kl, rel=1e-5)
    # with kl_coef=0 the KL is reported but does not change the loss
    monitored = policy_loss(logprobs, old, behaviour, adv, mask, mode="ppo", ref_logprobs=ref)
    assert monitored.loss.item() == pytest.approx(-1.189, abs=1e-6)
    assert monitored.mean_kl is not None
    assert monitored.mean_kl.item() == pytest.approx(mean_kl, rel=1e-5)


def test_kl_gradient_pulls_towards_the_reference() -> None:
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-0.5, -2.5]])
    nothing = torch.full((1, 2), math.nan)
    out = policy_loss(
        logprobs,
        None,
        nothing,
        torch.zeros(1),
        torch.ones(1, 2, dtype=torch.bool),
        mode="ppo",
        ref_logprobs=ref,
        kl_coef=1.0,
    )
    out.loss.backward()
    assert logprobs.grad is not None
    # d/dlogπ [exp(ref - logπ) - (ref - logπ) - 1] = 1 - exp(ref - logπ), averaged over 2 tokens
    expected = torch.tensor([[1 - math.exp(0.5), 1 - math.exp(-0.5)]]) / 2
    torch.testing.assert_close(logprobs.grad, expected)


def test_on_policy_step_reduces_to_reinforce_with_token_mean() -> None:
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    unknown = torch.full((2, 3), math.nan)
    for mode in ("ppo", "cispo"):
        logprobs.grad = None
        out = policy_loss(logprobs, None, unknown, torch.tensor([1.0, -2.0]), mask, mode=mode)
        out.loss.backward()
        assert logprobs.grad is not None
        # every token weighs 1/3 (3 loss tokens in the batch), gradient -A/N, regardless of length
        torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.0, -1.0, 0.0], [2.0, 0.0, 0.0]]) / 3)
        assert out.mean_ratio.item() == 1.0
        assert out.mean_importance_weight.item() == 1.0
        assert out.clip_fraction.item() == 0.0


def test_normaliser_makes_micro_batches_add_up_to_the_full_batch() -> None:
    logprobs, old, behaviour, adv, mask = _inputs()
    full = policy_loss(logprobs, old, behaviour, adv, mask, mode="ppo").loss
    (full_grad,) = torch.autograd.grad(full, logprobs)
    parts = [
        policy_loss(
            logprobs[i : i + 1],
            old[i : i + 1],
            behaviour[i : i + 1],
            adv[i : i + 1],
            mask[i : i + 1],
            mode="ppo",
            normaliser=N_TOKENS,
        ).loss
        for i in range(2)
    ]
    (parts_grad,) = torch.autograd.grad(parts[0] + parts[1], logprobs)
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), abs=1e-6)
    torch.testing.assert_close(parts_grad, full_grad)


def test_empty_mask_gives_zero_loss_that_still_backpropagates() -> None:
    logprobs = torch.randn(2, 4, requires_grad=True)
    out = policy_loss(
        logprobs,
        None,
        torch.full((2, 4), math.nan),
        torch.ones(2),
        torch.zeros(2, 4, dtype=torch.bool),
        mode="ppo",
    )
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert out.num_tokens == 0
    assert logprobs.grad is not None
    assert not logprobs.grad.any()


def test_invalid_arguments() -> None:
    logprobs, old, behaviour, adv, mask = _inputs()
    with pytest.raises(ValueError, match="mode"):
        policy_loss(logprobs, old, behaviour, adv, mask, mode="reinforce")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        policy_loss(logprobs, old, behaviour[:, :2], adv, mask, mode="ppo")
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logprobs, old, behaviour, adv[:1], mask, mode="ppo")
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logprobs, old, behaviour, adv, mask, mode="ppo", kl_coef=0.1)


# --- one optimiser step on real models moves log-probabilities the way the advantage says ---------

VOCAB = 32


class BigramLM(nn.Module):
    """Smallest causal LM: the next-token distribution depends on the current token only."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.embed(input_ids)))


def _sample(advantage: float, behaviour: list[float | None] | None = None) -> TokenizedSample:
    ids = [1, 5, 9, 14, 3, 22, 7]  # 3 prompt tokens, 4 assistant tokens
    mask = [False, False, False, True, True, True, True]
    return TokenizedSample(ids, mask, behaviour or [None] * len(ids), advantage)


def _reply_logprob(model: nn.Module, sample: TokenizedSample) -> float:
    batch = collate([sample], pad_id=0)
    with torch.no_grad():
        lp = token_logprobs(model(batch.input_ids), batch.targets)
    return float(lp[batch.loss_mask].sum())


@pytest.mark.parametrize("mode", ["ppo", "cispo"])
@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_one_step_on_a_tiny_lm_follows_the_advantage(mode: LossMode, advantage: float) -> None:
    torch.manual_seed(0)
    model = BigramLM()
    # behaviour logprobs from a "sampler" slightly different from the trainer, one of them unknown
    probe = collate([_sample(advantage)], pad_id=0)
    with torch.no_grad():
        sampled = token_logprobs(model(probe.input_ids), probe.targets)[0].tolist()
    behaviour: list[float | None] = [None, None, None, sampled[2] - 0.1, sampled[3] + 0.3, None, sampled[5]]
    sample = _sample(advantage, behaviour)

    before = _reply_logprob(model, sample)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.5)
    batch = collate([sample], pad_id=0)
    logprobs = token_logprobs(model(batch.input_ids), batch.targets)
    out = policy_loss(logprobs, None, batch.behaviour_logprobs, batch.advantages, batch.loss_mask, mode=mode)
    out.loss.backward()
    optimiser.step()
    after = _reply_logprob(model, sample)

    assert out.num_tokens == 4
    assert out.mean_importance_weight.item() != 1.0  # the captured behaviour logprobs were used
    assert (after - before) * advantage > 1e-3, (before, after)


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_one_step_on_a_tiny_llama_lora_follows_the_advantage(advantage: float) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = get_peft_model(
        LlamaForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    samples = [_sample(advantage), TokenizedSample([2, 4, 6], [False, True, True], [None, None, None], 0.0)]
    batch = collate(samples, pad_id=0)

    def reply_logprob() -> float:
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            return float(token_logprobs(logits, batch.targets)[0][batch.loss_mask[0]].sum())

    before = reply_logprob()
    optimiser = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logprobs = token_logprobs(logits, batch.targets)
    policy_loss(
        logprobs, None, batch.behaviour_logprobs, batch.advantages, batch.loss_mask, mode="cispo"
    ).loss.backward()
    optimiser.step()
    after = reply_logprob()

    assert (after - before) * advantage > 1e-3, (before, after)


# SFT: B=2, T=3; the masked-out token [1][2] holds -inf to show padding garbage cannot leak in.
SFT_LOGPROBS = [[-0.5, -1.0, -2.0], [-0.25, -3.0, -math.inf]]
SFT_MASK = [[False, True, True], [True, True, False]]


def test_sft_loss_by_hand() -> None:
    logprobs = torch.tensor(SFT_LOGPROBS, requires_grad=True)
    out = sft_loss(logprobs, torch.tensor(SFT_MASK))
    # -(-1.0 - 2.0 - 0.25 - 3.0) / 4 tokens
    assert out.loss.item() == pytest.approx(6.25 / 4)
    assert out.mean_nll.item() == pytest.approx(6.25 / 4)
    assert out.num_tokens == 4
    out.loss.backward()
    assert logprobs.grad is not None
    # d loss / d logπ = -1/4 on every masked token, 0 elsewhere (also where logπ is -inf)
    assert logprobs.grad.tolist() == [[0.0, -0.25, -0.25], [-0.25, -0.25, 0.0]]


def test_sft_loss_weight_and_normaliser_scale_the_loss_not_the_reported_nll() -> None:
    logprobs = torch.tensor(SFT_LOGPROBS)
    out = sft_loss(logprobs, torch.tensor(SFT_MASK), weight=0.5, normaliser=10.0)
    assert out.loss.item() == pytest.approx(0.5 * 6.25 / 10)
    assert out.mean_nll.item() == pytest.approx(6.25 / 4)
    empty = sft_loss(logprobs, torch.zeros(2, 3, dtype=torch.bool))
    assert (empty.loss.item(), empty.num_tokens) == (0.0, 0)


def test_sft_loss_refuses_misshapen_input() -> None:
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        sft_loss(torch.zeros(3), torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask has shape"):
        sft_loss(torch.zeros(2, 3), torch.zeros(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="non-negative"):
        sft_loss(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bool), weight=-1.0)


def test_one_sft_step_on_a_tiny_lm_makes_the_demonstration_likelier() -> None:
    torch.manual_seed(0)
    model = BigramLM()
    sample = _sample(0.0)
    before = _reply_logprob(model, sample)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.5)
    batch = collate([sample], pad_id=0)
    sft_loss(token_logprobs(model(batch.input_ids), batch.targets), batch.loss_mask).loss.backward()
    optimiser.step()
    assert _reply_logprob(model, sample) > before + 1e-3
