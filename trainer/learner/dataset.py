"""From stored episodes to trajectories: selection, filters and the cap, with every left-out episode counted.

An episode's trajectory is its last call's messages plus that call's reply (choice 0), and every assistant turn
in it is one of its calls' replies: an earlier call whose messages the last call's messages extend, and whose
reply (one of its choices) follows them there. Each turn keeps the prompt and reply token ids the engine sampled
and their behaviour logprobs, so the trainer never re-tokenises what the policy actually produced.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from storage.training import CallRow, EpisodeRow
from trainer.control.policy_config import TrainConfig
from trainer.control.rollouts import (
    RolloutTask,
    carried_options,
    episode_start,
    recorded_results,
    tool_call_key,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Turn:
    """An earlier assistant turn of an episode: the conversation it answered, its reply, and its tokens."""

    context: list[dict[str, Any]]
    reply: dict[str, Any]
    prompt_token_ids: list[int] | None
    completion_token_ids: list[int] | None
    completion_logprobs: list[float] | None
    #: The call's request options a rollout repeats at this turn (`trainer.control.rollouts.carried_options`).
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainingExample:
    """One attempt at a task: the context before its final assistant turn, that turn, its earlier turns and its
    reward. Every assistant turn of the attempt carries the attempt's advantage."""

    episode_id: str
    context: list[dict[str, Any]]
    tools: list[Any] | None
    reply: dict[str, Any]
    reward: float
    #: The engine's prompt ids for `context` (chat template applied by the engine); None if not captured.
    prompt_token_ids: list[int] | None
    completion_token_ids: list[int] | None
    completion_logprobs: list[float] | None
    #: The episode's earlier assistant turns, oldest first.
    earlier: list[Turn] = field(default_factory=list)
    context_hash: str | None = None
    group_key: str | None = None
    #: `captured` (served traffic) or `resampled` (sampled by the trainer for a `resample` group).
    origin: str = "captured"
    #: The final call's request options a rollout repeats at its last turn.
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def reply_text(self) -> str:
        content = self.reply.get("content")
        return content if isinstance(content, str) else ""

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The whole conversation, as a scorer sees it."""
        return [*self.context, self.reply]

    @property
    def start(self) -> list[dict[str, Any]]:
        """Where a rollout of this attempt starts (`trainer.control.rollouts.episode_start`)."""
        return episode_start(self.context)

    @property
    def agent_turns(self) -> list[Turn]:
        """The earlier turns a rollout re-runs: those after the start (the others are part of the task)."""
        start = len(self.start)
        return [turn for turn in self.earlier if len(turn.context) >= start]

    def rollout_task(self) -> RolloutTask:
        """How a rollout re-runs this attempt: from its start, with its tools, each turn with the options the
        captured call at that turn had, replaying its recorded tool results for identical calls."""
        options = [turn.options for turn in self.agent_turns] + [self.options]
        return RolloutTask(self.start, self.tools, options, recorded_results(self.messages))


@dataclass
class DataReport:
    """Counters of everything selected, filtered, dropped or skipped on the way to the update."""

    counts: Counter[str] = field(default_factory=Counter)

    def add(self, reason: str, n: int = 1) -> None:
        if n:
            self.counts[reason] += n

    def as_dict(self) -> dict[str, int]:
        return dict(sorted(self.counts.items()))


def _matches(meta: dict[str, Any], wanted: dict[str, Any]) -> bool:
    return all(meta.get(k) == v for k, v in wanted.items())


def select_episodes(episodes: list[EpisodeRow], cfg: TrainConfig, report: DataReport) -> list[EpisodeRow]:
    """Apply tag, metadata and reward-count filters, then keep the newest `max_episodes`."""
    report.add("episodes_rewarded", len(episodes))
    if not episodes:
        return []
    by_id = {e.id: e for e in episodes}
    frame = pl.DataFrame(
        {
            "id": [e.id for e in episodes],
            "created_at": [e.created_at for e in episodes],
            "reward_count": [e.reward_count for e in episodes],
            "tags_ok": [all(t in e.tags for t in cfg.tags) for e in episodes],
            "meta_ok": [_matches(e.meta, cfg.metadata) for e in episodes],
        }
    )
    for column, reason in (("tags_ok", "filtered_tags"), ("meta_ok", "filtered_metadata")):
        kept = frame.filter(pl.col(column))
        report.add(reason, frame.height - kept.height)
        frame = kept
    kept = frame.filter(pl.col("reward_count") >= cfg.min_rewards)
    report.add("filtered_min_rewards", frame.height - kept.height)
    frame = kept.sort("created_at", descending=True)
    report.add("capped", max(frame.height - cfg.max_episodes, 0))
    frame = frame.head(cfg.max_episodes).sort("created_at")
    return [by_id[i] for i in frame["id"].to_list()]


def _choice_ids(call: CallRow, index: int) -> tuple[list[int] | None, list[float] | None]:
    ids = (
        call.completion_token_ids[index]
        if call.completion_token_ids and index < len(call.completion_token_ids)
        else None
    )
    lps = (
        call.completion_logprobs[index]
        if call.completion_logprobs and index < len(call.completion_logprobs)
        else None
    )
    if ids is not None and lps is not None and len(lps) != len(ids):
        lps = None  # misaligned logprobs are worse than none: treat them as unknown
    return ids, lps


def same_turn(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two assistant messages say the same (the reply as served, and as the app sent it back): the same
    text, and the same tool calls with the same arguments."""
    if (a.get("content") or "") != (b.get("content") or ""):
        return False
    calls_a = [tool_call_key(c) for c in a.get("tool_calls") or [] if isinstance(c, Mapping)]
    calls_b = [tool_call_key(c) for c in b.get("tool_calls") or [] if isinstance(c, Mapping)]
    return calls_a == calls_b


def _earlier_turn(call: CallRow, final: list[dict[str, Any]], report: DataReport) -> Turn | None:
    """The turn `call` contributed to the conversation `final`, or None (counted) when the conversation did not
    continue from it (a retried or abandoned call) or from none of its replies."""
    messages = list(call.request.get("messages") or [])
    if call.status != "ok" or len(messages) >= len(final) or final[: len(messages)] != messages:
        report.add("earlier_turns_unmatched")
        return None
    following = final[len(messages)]
    choices = (call.response or {}).get("choices") or []
    for index, choice in enumerate(choices):
        message = choice.get("message") if isinstance(choice, dict) else None
        if (
            isinstance(message, dict)
            and following.get("role") == "assistant"
            and same_turn(message, following)
        ):
            ids, lps = _choice_ids(call, index)
            return Turn(
                context=messages,
                reply=dict(following),
                prompt_token_ids=list(call.prompt_token_ids) if call.prompt_token_ids else None,
                completion_token_ids=list(ids) if ids else None,
                completion_logprobs=list(lps) if lps else None,
                options=carried_options(call.request),
            )
    report.add("earlier_turns_unmatched")
    return None


def build_example(episode: EpisodeRow, calls: list[CallRow], report: DataReport) -> TrainingExample | None:
    """The trajectory of an episode, or None (counted) when its last call has no usable reply."""
    if not calls:
        report.add("dropped_no_calls")
        return None
    last = calls[-1]
    choices = (last.response or {}).get("choices") or []
    message = choices[0].get("message") if choices else None
    if last.status != "ok" or not isinstance(message, dict):
        report.add("dropped_no_reply")
        return None
    ids, lps = _choice_ids(last, 0)
    context = list(last.request.get("messages") or [])
    earlier = [turn for call in calls[:-1] if (turn := _earlier_turn(call, context, report)) is not None]
    return TrainingExample(
        episode_id=episode.id,
        context=context,
        tools=last.request.get("tools"),
        reply={k: v for k, v in message.items() if v is not None},
        reward=episode.reward,
        prompt_token_ids=list(last.prompt_token_ids) if last.prompt_token_ids else None,
        completion_token_ids=list(ids) if ids else None,
        completion_logprobs=list(lps) if lps else None,
        earlier=earlier,
        context_hash=last.context_hash,
        group_key=episode.group_key or last.group_key,
        options=carried_options(last.request),
    )
