"""Credit over whole episodes: every assistant turn of an attempt carries the attempt's advantage, and a token
every member of a group sampled in the same context gets no push, even when the members are trained in
different optimizer steps.

The policy here is a table: one row of logits per context (the ids before a token), so a gradient on a row is the
push the loss gives that context's next token, and nothing else moves it. All logits start at 0 (p = 1/V), which
makes the gradients computable by hand: at ratio 1 with unknown behaviour logprobs (weight 1), the loss on N
tokens is -(A/N) Σ log π, and d log π(t) / d logit(t) = 1 - 1/V.
"""

from __future__ import annotations

import math

import pytest
import torch

from trainer.control.policy_config import TrainConfig
from trainer.learner.batch import TokenizedSample
from trainer.learner.dataset import DataReport, TrainingExample, Turn
from trainer.learner.loss import policy_loss
from trainer.learner.tokens import mask_shared_tokens, tokenize

V = 128
PROMPT = [1, 2, 3]
RESULT = 50  # the tool's answer, the same for both members
END = 2


class Table(torch.nn.Module):
    """Logits per context, looked up by the ids before the token."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[tuple[int, ...], int] = {}
        self.logits = torch.nn.Parameter(torch.zeros(64, V))

    def row(self, context: list[int]) -> int:
        return self.rows.setdefault(tuple(context), len(self.rows))

    def loss(self, samples: list[TokenizedSample]) -> torch.Tensor:
        """The policy loss of one optimizer step over `samples`."""
        width = max(len(s.input_ids) for s in samples) - 1
        logprobs = torch.zeros(len(samples), width)
        mask = torch.zeros(len(samples), width, dtype=torch.bool)
        for b, sample in enumerate(samples):
            for p in range(1, len(sample.input_ids)):
                row = self.logits[self.row(sample.input_ids[:p])]
                logprobs[b, p - 1] = torch.log_softmax(row, -1)[sample.input_ids[p]]
                mask[b, p - 1] = sample.loss_mask[p]
        behaviour = torch.full_like(logprobs, math.nan)
        advantages = torch.tensor([s.advantage for s in samples])
        return policy_loss(logprobs, None, behaviour, advantages, mask, mode="ppo").loss


def attempt(first_turn: list[int], answer: int, reward: float) -> TrainingExample:
    """A tool call (`first_turn`), the tool's result, then the final answer: two assistant turns."""
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"name": "f"}}]}
    user = [{"role": "user", "content": "q"}]
    earlier = Turn(user, call, PROMPT, first_turn, None)
    return TrainingExample(
        episode_id=f"e{answer}",
        context=[*user, call, {"role": "tool", "tool_call_id": "c", "content": "r"}],
        tools=None,
        reply={"role": "assistant", "content": "a"},
        reward=reward,
        prompt_token_ids=[*PROMPT, *first_turn, RESULT],
        completion_token_ids=[answer, END],
        completion_logprobs=None,
        earlier=[earlier],
    )


def gradients(table: Table, members: list[list[TokenizedSample]]) -> list[torch.Tensor]:
    """Each member's gradient alone: as if every member landed in a step of its own."""
    out = []
    for samples in members:
        table.zero_grad()
        table.loss(samples).backward()
        assert table.logits.grad is not None
        out.append(table.logits.grad.clone())
    return out


def group(first_turns: tuple[list[int], list[int]], masked: bool = True) -> list[list[TokenizedSample]]:
    """Two attempts, the first rewarded 1 and the second 0 (advantages +0.5 and -0.5)."""
    examples = [attempt(first_turns[0], 60, 1.0), attempt(first_turns[1], 61, 0.0)]
    members = [
        tokenize(e, a, None, TrainConfig(), DataReport()) for e, a in zip(examples, (0.5, -0.5), strict=True)
    ]
    return mask_shared_tokens(members, DataReport()) if masked else members


def test_an_identical_first_turn_gets_no_push_from_either_member() -> None:
    table = Table()
    members = group(([40, 41], [40, 41]))
    # Both turns of each attempt are in one sample; the shared tool call is out of the loss, the answers are not.
    for samples in members:
        [sample] = samples
        assert [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m] in (
            [60, END],
            [61, END],
        )
    good, bad = gradients(table, members)
    for context in (PROMPT, [*PROMPT, 40]):
        assert torch.equal(good[table.row(context)], torch.zeros(V))
        assert torch.equal(bad[table.row(context)], torch.zeros(V))
    answer = table.row([*PROMPT, 40, 41, RESULT])
    # By hand: N = 2 loss tokens each (the answer and the end of turn).
    assert good[answer, 60].item() == pytest.approx(-(0.5 / 2) * (1 - 1 / V))
    assert bad[answer, 61].item() == pytest.approx(+(0.5 / 2) * (1 - 1 / V))


def test_without_the_mask_the_shared_turn_is_pushed_in_each_step() -> None:
    """What the mask prevents: trained in separate steps, each member pushes the shared call its own way."""
    table = Table()
    good, bad = gradients(table, group(([40, 41], [40, 41]), masked=False))
    row = table.row(PROMPT)
    assert good[row, 40].item() == pytest.approx(-(0.5 / 4) * (1 - 1 / V))
    assert bad[row, 40].item() == pytest.approx(+(0.5 / 4) * (1 - 1 / V))


def test_a_first_turn_that_differs_is_credited_where_it_differs() -> None:
    """The members call the same tool (token 40) with different arguments (41 and 42): the shared token gets no
    push, the argument each member chose gets its member's advantage, and so does every later turn."""
    table = Table()
    members = group(([40, 41], [40, 42]))
    good, bad = gradients(table, members)
    assert torch.equal(good[table.row(PROMPT)], torch.zeros(V))
    assert torch.equal(bad[table.row(PROMPT)], torch.zeros(V))
    argument = table.row([*PROMPT, 40])
    # N = 3 loss tokens each: the argument, the answer and the end of turn.
    assert good[argument, 41].item() == pytest.approx(-(0.5 / 3) * (1 - 1 / V))
    assert bad[argument, 42].item() == pytest.approx(+(0.5 / 3) * (1 - 1 / V))
    assert good[table.row([*PROMPT, 40, 41, RESULT]), 60].item() < 0
    assert bad[table.row([*PROMPT, 40, 42, RESULT]), 61].item() > 0


def test_together_in_one_step_the_shared_turn_nets_to_zero_either_way() -> None:
    """In one step the advantages cancel on a shared token whether or not it is masked: masking changes the
    noise across steps, not what one full-batch step does to it."""
    table = Table()
    for masked in (True, False):
        table.zero_grad()
        table.loss([s for m in group(([40, 41], [40, 41]), masked) for s in m]).backward()
        assert table.logits.grad is not None
        assert table.logits.grad[table.row(PROMPT)].abs().max().item() == pytest.approx(0.0, abs=1e-9)
