import math

import pytest
import torch

from trainer.learner.batch import Batch, TokenizedSample, collate, token_entropy, token_logprobs

PAD = 0


def _samples() -> list[TokenizedSample]:
    # sample 0: prompt 11 12, assistant 21 22 23 (23 has no captured logprob)
    first = TokenizedSample(
        input_ids=[11, 12, 21, 22, 23],
        loss_mask=[False, False, True, True, True],
        behaviour_logprobs=[None, None, -0.5, -1.5, None],
        advantage=0.75,
    )
    # sample 1: prompt 13, assistant 24 25
    second = TokenizedSample(
        input_ids=[13, 24, 25],
        loss_mask=[False, True, True],
        behaviour_logprobs=[None, -0.25, -2.0],
        advantage=-0.75,
    )
    return [first, second]


def test_collate_pads_and_shifts() -> None:
    batch = collate(_samples(), pad_id=PAD)
    assert isinstance(batch, Batch)
    assert batch.input_ids.tolist() == [[11, 12, 21, 22], [13, 24, PAD, PAD]]
    assert batch.targets.tolist() == [[12, 21, 22, 23], [24, 25, PAD, PAD]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch.loss_mask.tolist() == [[False, True, True, True], [True, True, False, False]]
    assert batch.advantages.tolist() == [0.75, -0.75]
    assert batch.num_loss_tokens == 5
    assert batch.input_ids.dtype == torch.long
    assert batch.targets.dtype == torch.long
    assert batch.behaviour_logprobs.dtype == torch.float32


def test_collate_aligns_behaviour_logprobs_with_targets() -> None:
    beh = collate(_samples(), pad_id=PAD).behaviour_logprobs
    # row 0 targets (12, 21, 22, 23): 12 is prompt -> NaN, 23 unknown -> NaN
    assert torch.isnan(beh[0, 0])
    assert torch.isnan(beh[0, 3])
    assert beh[0, 1].item() == -0.5
    assert beh[0, 2].item() == -1.5
    assert beh[1, :2].tolist() == [-0.25, -2.0]
    assert torch.isnan(beh[1, 2:]).all()


def test_collate_ignores_logprobs_outside_the_loss_mask() -> None:
    sample = TokenizedSample([1, 2, 3], [False, False, True], [None, -9.0, -1.0], advantage=1.0)
    beh = collate([sample], pad_id=PAD).behaviour_logprobs
    assert torch.isnan(beh[0, 0])
    assert beh[0, 1].item() == -1.0


def test_sample_validation() -> None:
    with pytest.raises(ValueError, match="align"):
        TokenizedSample([1, 2, 3], [False, True], [None, None, None], advantage=0.0)
    with pytest.raises(ValueError, match="align"):
        TokenizedSample([1, 2, 3], [False, True, True], [None, None], advantage=0.0)
    with pytest.raises(ValueError, match="two tokens"):
        TokenizedSample([1], [True], [None], advantage=0.0)
    with pytest.raises(ValueError, match="finite"):
        TokenizedSample([1, 2], [False, True], [None, None], advantage=math.nan)
    with pytest.raises(ValueError, match="empty"):
        collate([], pad_id=PAD)


@pytest.mark.parametrize("chunk_rows", [1, 3, 4096])
def test_token_logprobs_matches_log_softmax_and_its_gradient(chunk_rows: int) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 5, 11, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    targets = torch.randint(0, 11, (2, 5), generator=gen)
    upstream = torch.randn(2, 5, generator=gen, dtype=torch.float64)

    ours = token_logprobs(logits, targets, chunk_rows=chunk_rows)
    (grad_ours,) = torch.autograd.grad((ours * upstream).sum(), logits)
    reference = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (grad_ref,) = torch.autograd.grad((reference * upstream).sum(), logits)

    assert ours.dtype == torch.float32
    assert ours.shape == (2, 5)
    torch.testing.assert_close(ours, reference.float())
    torch.testing.assert_close(grad_ours, grad_ref, rtol=1e-6, atol=1e-6)
    assert grad_ours.dtype == logits.dtype


def test_token_logprobs_in_bf16_is_computed_in_float32() -> None:
    gen = torch.Generator().manual_seed(1)
    logits32 = torch.randn(3, 7, 50, generator=gen) * 4
    targets = torch.randint(0, 50, (3, 7), generator=gen)
    logits16 = logits32.to(torch.bfloat16).requires_grad_()
    ours = token_logprobs(logits16, targets, chunk_rows=5)
    reference = torch.log_softmax(logits16.detach().float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-5)
    ours.sum().backward()
    assert logits16.grad is not None
    assert logits16.grad.dtype == torch.bfloat16
    # each row's gradient is onehot - softmax, which sums to ~0 over the vocabulary
    assert logits16.grad.float().sum(-1).abs().max().item() < 0.05


def test_token_logprobs_shape_errors() -> None:
    with pytest.raises(ValueError, match="expected logits"):
        token_logprobs(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="expected logits"):
        token_logprobs(torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.long))


def test_token_entropy() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 9, generator=gen, dtype=torch.float64)
    probs = torch.softmax(logits, -1)
    reference = -(probs * probs.log()).sum(-1)
    torch.testing.assert_close(token_entropy(logits, chunk_rows=4), reference.float())
    # uniform over 8 -> log 8; one-hot (others -inf) -> 0 without NaN
    assert token_entropy(torch.zeros(1, 1, 8)).item() == pytest.approx(math.log(8))
    peaked = torch.full((1, 1, 5), -math.inf)
    peaked[0, 0, 2] = 0.0
    assert token_entropy(peaked).item() == 0.0
