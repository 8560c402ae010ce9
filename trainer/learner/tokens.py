"""Trajectories to training tokens, from the token ids the engine captured (no re-tokenisation drift).

The final assistant turn carries the loss on exactly the ids that were sampled, with their behaviour logprobs.
Earlier assistant turns carry loss too when the ids their own call sampled are found at the expected place in
the final prompt (the chat template rendered them back unchanged); otherwise they stay context, like tool and
user turns. A reply whose ids were captured without the prompt's keeps its ids and logprobs on a context rendered
with the chat template (counted). A call without captured ids (capture-only upstream traffic) is re-tokenised
with the chat template, flagged, and its behaviour logprobs are unknown (importance weight 1).
"""

from __future__ import annotations

import logging
from typing import Any

from trainer.control.policy_config import TrainConfig
from trainer.learner.batch import TokenizedSample
from trainer.learner.dataset import DataReport, TrainingExample

logger = logging.getLogger(__name__)


def _template_ids(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[Any] | None, *, generation: bool
) -> list[int]:
    ids = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=generation, tokenize=True, return_dict=False
    )
    return [int(i) for i in ids]


def prompt_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: list[Any] | None) -> list[int]:
    """The context as the engine renders it for sampling: the chat template with the generation prompt."""
    return _template_ids(tokenizer, messages, tools, generation=True)


def retokenise(tokenizer: Any, trajectory: TrainingExample) -> tuple[list[int], list[int]]:
    """Prompt and reply ids from text: the fallback for traffic captured without token ids."""
    prompt = prompt_ids(tokenizer, trajectory.context, trajectory.tools)
    full = _template_ids(
        tokenizer, [*trajectory.context, trajectory.reply], trajectory.tools, generation=False
    )
    if full[: len(prompt)] == prompt and len(full) > len(prompt):
        reply = full[len(prompt) :]
        # The template's trailing newline after the end-of-turn token was never sampled.
        end = tokenizer.eos_token_id
        if end in reply:
            reply = reply[: reply.index(end) + 1]
        return prompt, reply
    reply = [int(i) for i in tokenizer.encode(trajectory.reply_text, add_special_tokens=False)]
    return prompt, [*reply, int(tokenizer.eos_token_id)]


def _mark_earlier_turns(
    prompt: list[int],
    trajectory: TrainingExample,
    mask: list[bool],
    behaviour: list[float | None],
    report: DataReport,
) -> None:
    for turn in trajectory.earlier:
        start = len(turn.prompt_token_ids)
        if prompt[:start] != turn.prompt_token_ids:
            report.add("earlier_turns_unmatched")
            continue
        for ids, lps in turn.choices:
            if prompt[start : start + len(ids)] == ids:
                for offset in range(len(ids)):
                    mask[start + offset] = True
                    behaviour[start + offset] = lps[offset] if lps is not None else None
                report.add("earlier_turns_trained")
                break
        else:
            report.add("earlier_turns_unmatched")


def tokenize(
    trajectory: TrainingExample, advantage: float, tokenizer: Any, cfg: TrainConfig, report: DataReport
) -> TokenizedSample | None:
    """One training sample, or None (counted) when it is over length under `drop` or has no reply tokens."""
    retokenised = not trajectory.completion_token_ids
    if trajectory.completion_token_ids:
        if trajectory.prompt_token_ids is not None:
            prompt = list(trajectory.prompt_token_ids)
        else:
            # The sampled ids are known but not the prompt's: the context is rendered with the chat template,
            # the reply stays exactly what was sampled.
            report.add("context_from_template")
            prompt = prompt_ids(tokenizer, trajectory.context, trajectory.tools)
        reply = list(trajectory.completion_token_ids)
        reply_lps: list[float | None] = (
            list(trajectory.completion_logprobs)
            if trajectory.completion_logprobs is not None
            else [None] * len(reply)
        )
        if trajectory.completion_logprobs is None:
            report.add("no_behaviour_logprobs")
    else:
        logger.warning("episode %s has no captured token ids: re-tokenising its text", trajectory.episode_id)
        report.add("retokenised")
        prompt, reply = retokenise(tokenizer, trajectory)
        reply_lps = [None] * len(reply)
    mask = [False] * len(prompt)
    behaviour: list[float | None] = [None] * len(prompt)
    if not retokenised:
        _mark_earlier_turns(prompt, trajectory, mask, behaviour, report)
    ids = prompt + reply
    mask += [True] * len(reply)
    behaviour += reply_lps
    if len(ids) > cfg.max_length:
        if cfg.overlong == "drop":
            report.add("dropped_overlong")
            return None
        report.add("truncated_overlong")
        ids, mask, behaviour = ids[: cfg.max_length], mask[: cfg.max_length], behaviour[: cfg.max_length]
    if not any(mask[1:]):
        report.add("dropped_no_reply_tokens")
        return None
    return TokenizedSample(ids, mask, behaviour, advantage)
