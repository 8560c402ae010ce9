"""Trajectories to training tokens, from the token ids the engine captured (no re-tokenisation drift).

Every assistant turn of a trajectory carries the loss on exactly the ids that were sampled, with their behaviour
logprobs, and the trajectory's advantage. A turn is trained inside a later turn's sample when its ids sit at
their place in that later prompt (the chat template rendered them back unchanged), otherwise in a sample of its
own (its prompt plus its reply): a tool call the template re-renders with other whitespace is trained all the
same. A reply whose ids were captured without the prompt's keeps its ids and logprobs on a context rendered with
the chat template (counted). A turn without captured ids (capture-only upstream traffic) is re-tokenised with
the chat template, flagged, and its behaviour logprobs are unknown (importance weight 1).

Within a group, a token every member sampled in the same context (an identical earlier turn, the identical start
of replies that then differ) gets no push: the group's advantages sum to zero, so its gradient is noise, and in
different optimizer steps not even zero noise. `mask_shared_tokens` takes such tokens out of the loss.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Literal

from trainer.control.policy_config import TrainConfig
from trainer.learner.batch import TokenizedSample
from trainer.learner.dataset import DataReport, TrainingExample

logger = logging.getLogger(__name__)

#: Which turns of a trajectory are trained (see `segments`).
Turns = Literal["agent", "all"]


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


def retokenise(
    tokenizer: Any, context: list[dict[str, Any]], reply: dict[str, Any], tools: list[Any] | None
) -> tuple[list[int], list[int]]:
    """Prompt and reply ids from text: the fallback for traffic captured without token ids."""
    prompt = prompt_ids(tokenizer, context, tools)
    full = _template_ids(tokenizer, [*context, reply], tools, generation=False)
    if full[: len(prompt)] == prompt and len(full) > len(prompt):
        rendered = full[len(prompt) :]
        # The template's trailing newline after the end-of-turn token was never sampled.
        end = tokenizer.eos_token_id
        if end in rendered:
            rendered = rendered[: rendered.index(end) + 1]
        return prompt, rendered
    content = reply.get("content")
    text = content if isinstance(content, str) else ""
    ids = [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]
    return prompt, [*ids, int(tokenizer.eos_token_id)]


@dataclass(frozen=True)
class Segment:
    """One assistant turn as tokens: its prompt, its reply, and the reply's behaviour logprobs."""

    prompt: list[int]
    reply: list[int]
    logprobs: list[float | None]


def _segment(
    tokenizer: Any,
    context: list[dict[str, Any]],
    reply: dict[str, Any],
    tools: list[Any] | None,
    ids: tuple[list[int] | None, list[int] | None, list[float] | None],
    report: DataReport,
    episode_id: str,
) -> Segment:
    prompt_ids_captured, reply_ids, reply_lps = ids
    if reply_ids:
        if prompt_ids_captured is not None:
            prompt = list(prompt_ids_captured)
        else:
            # The sampled ids are known but not the prompt's: the context is rendered with the chat template,
            # the reply stays exactly what was sampled.
            report.add("context_from_template")
            prompt = prompt_ids(tokenizer, context, tools)
        if reply_lps is None:
            report.add("no_behaviour_logprobs")
        logprobs: list[float | None] = list(reply_lps) if reply_lps is not None else [None] * len(reply_ids)
        return Segment(prompt, list(reply_ids), logprobs)
    logger.warning("episode %s has a turn without captured token ids: re-tokenising its text", episode_id)
    report.add("retokenised")
    prompt, text_ids = retokenise(tokenizer, context, reply, tools)
    return Segment(prompt, text_ids, [None] * len(text_ids))


def _embedded(ids: list[int], segment: Segment) -> bool:
    start = len(segment.prompt)
    return ids[:start] == segment.prompt and ids[start : start + len(segment.reply)] == segment.reply


def segments(
    trajectory: TrainingExample, tokenizer: Any, report: DataReport, turns: Turns = "agent"
) -> list[Segment]:
    """The trajectory's turns as tokens, oldest first, the final turn last: `agent`, those after its start (a
    `resample` group's members share the rest), or `all` (whole episodes compared from their first turn)."""
    earlier = trajectory.agent_turns if turns == "agent" else trajectory.earlier
    found = [
        _segment(
            tokenizer,
            turn.context,
            turn.reply,
            trajectory.tools,
            (turn.prompt_token_ids, turn.completion_token_ids, turn.completion_logprobs),
            report,
            trajectory.episode_id,
        )
        for turn in earlier
    ]
    final_ids = (trajectory.prompt_token_ids, trajectory.completion_token_ids, trajectory.completion_logprobs)
    found.append(
        _segment(
            tokenizer,
            trajectory.context,
            trajectory.reply,
            trajectory.tools,
            final_ids,
            report,
            trajectory.episode_id,
        )
    )
    return found


def pack(turns: list[Segment], advantage: float) -> list[TokenizedSample]:
    """As few samples as hold every turn: each later turn's sample trains the earlier turns found in it."""
    samples: list[TokenizedSample] = []
    left = list(range(len(turns)))
    while left:
        last = turns[left.pop()]
        ids = last.prompt + last.reply
        mask = [False] * len(last.prompt) + [True] * len(last.reply)
        behaviour: list[float | None] = [None] * len(last.prompt)
        behaviour += last.logprobs
        for index in list(left):
            turn = turns[index]
            if _embedded(last.prompt, turn):
                start = len(turn.prompt)
                for offset in range(len(turn.reply)):
                    mask[start + offset] = True
                    behaviour[start + offset] = turn.logprobs[offset]
                left.remove(index)
        samples.append(TokenizedSample(ids, mask, behaviour, advantage))
    samples.reverse()
    return samples


def tokenize(
    trajectory: TrainingExample,
    advantage: float,
    tokenizer: Any,
    cfg: TrainConfig,
    report: DataReport,
    turns: Turns = "agent",
) -> list[TokenizedSample]:
    """The trajectory's training samples (none, counted, when it is over length under `drop`, or has no reply
    tokens). A trajectory of several turns that does not fit is left out whole: cutting its last reply and
    training the turns before it on the outcome would credit them with an ending they never had."""
    found = segments(trajectory, tokenizer, report, turns)
    packed = pack(found, advantage)
    if len(found) > 1:
        report.add("turns_of_several_turn_episodes", len(found))
        report.add("samples_of_several_turn_episodes", len(packed))
    overlong = [s for s in packed if len(s.input_ids) > cfg.max_length]
    if overlong and (cfg.overlong == "drop" or len(found) > 1):
        report.add("dropped_overlong")
        return []
    kept = []
    for sample in packed:
        fitted = sample
        if len(sample.input_ids) > cfg.max_length:
            report.add("truncated_overlong")
            limit = cfg.max_length
            fitted = TokenizedSample(
                sample.input_ids[:limit],
                sample.loss_mask[:limit],
                sample.behaviour_logprobs[:limit],
                advantage,
            )
        if not any(fitted.loss_mask[1:]):
            report.add("dropped_no_reply_tokens")
            continue
        kept.append(fitted)
    return kept


def mask_shared_tokens(
    members: list[list[TokenizedSample]], report: DataReport
) -> list[list[TokenizedSample]]:
    """The group's samples, each member's, with the tokens every member sampled in the same context taken out
    of the loss. A token is identified by everything up to and including it (a running hash of the ids)."""
    if len(members) < 2:
        return members
    keyed = [[_prefix_keys(sample) for sample in samples] for samples in members]
    per_member = [
        {
            key
            for sample, keys in zip(samples, member_keys, strict=True)
            for key, m in zip(keys, sample.loss_mask, strict=True)
            if m
        }
        for samples, member_keys in zip(members, keyed, strict=True)
    ]
    shared = set.intersection(*per_member)
    if not shared:
        return members
    out = []
    for samples, member_keys in zip(members, keyed, strict=True):
        kept = []
        for sample, keys in zip(samples, member_keys, strict=True):
            mask = [m and key not in shared for m, key in zip(sample.loss_mask, keys, strict=True)]
            report.add("tokens_shared_by_group", sum(sample.loss_mask) - sum(mask))
            if not any(mask[1:]):
                report.add("samples_all_shared")
                continue
            kept.append(replace(sample, loss_mask=mask))
        out.append(kept)
    return out


def _prefix_keys(sample: TokenizedSample) -> list[int]:
    keys = []
    running = 0
    for token in sample.input_ids:
        running = hash((running, token))
        keys.append(running)
    return keys
