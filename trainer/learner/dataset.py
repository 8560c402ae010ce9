"""From stored episodes to trajectories: selection, filters and the cap, with every left-out episode counted.

An episode's trajectory is its last call's messages plus that call's reply (choice 0). The token ids the engine
sampled for that reply, and for earlier assistant turns where they can be located in the last prompt, are kept
so the trainer never re-tokenises what the policy actually produced.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from storage.training import CallRow, EpisodeRow
from trainer.control.policy_config import TrainConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EarlierTurn:
    """An earlier call of the episode: where its sampled reply ids should sit inside the final prompt."""

    prompt_token_ids: list[int]
    #: One entry per choice; the one the conversation continued with is found by matching.
    choices: list[tuple[list[int], list[float] | None]]


@dataclass(frozen=True)
class TrainingExample:
    """One attempt at a task: the context before its final assistant turn, that turn, and its reward."""

    episode_id: str
    context: list[dict[str, Any]]
    tools: list[Any] | None
    reply: dict[str, Any]
    reward: float
    #: The engine's prompt ids for `context` (chat template applied by the engine); None if not captured.
    prompt_token_ids: list[int] | None
    completion_token_ids: list[int] | None
    completion_logprobs: list[float] | None
    earlier: list[EarlierTurn] = field(default_factory=list)
    context_hash: str | None = None
    group_key: str | None = None
    #: `captured` (served traffic) or `resampled` (sampled by the trainer for a `resample` group).
    origin: str = "captured"

    @property
    def reply_text(self) -> str:
        content = self.reply.get("content")
        return content if isinstance(content, str) else ""


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
    earlier = []
    for call in calls[:-1]:
        if call.prompt_token_ids and call.completion_token_ids:
            options = [_choice_ids(call, i) for i in range(len(call.completion_token_ids))]
            earlier.append(EarlierTurn(list(call.prompt_token_ids), [(i, lp) for i, lp in options if i]))
    return TrainingExample(
        episode_id=episode.id,
        context=list(last.request.get("messages") or []),
        tools=last.request.get("tools"),
        reply={k: v for k, v in message.items() if v is not None},
        reward=episode.reward,
        prompt_token_ids=list(last.prompt_token_ids) if last.prompt_token_ids else None,
        completion_token_ids=list(ids) if ids else None,
        completion_logprobs=list(lps) if lps else None,
        earlier=earlier,
        context_hash=last.context_hash,
        group_key=episode.group_key or last.group_key,
    )
