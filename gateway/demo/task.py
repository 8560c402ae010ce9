"""The demo's verifiable task: give the opposite of a word.

Chosen so that the reward is about content, not format: every question has its own answer, so a constant
reply is right for at most one question in sixty, an empty reply or one that ignores the question scores 0, and
a reply that lists several candidate answers to cover its bets scores 0 too. The embedded base model knows
many of these pairs but says so unreliably at temperature 1 (its measured level is in docs/training.md), so groups
have reward variance from the first cycle, and a model that learned the task still gives a different reply
to every question: the share of distinct replies stays high unless the policy collapses.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# word -> accepted opposites (the first is the usual one)
PAIRS: dict[str, tuple[str, ...]] = {
    "hot": ("cold",),
    "big": ("small", "little", "tiny"),
    "fast": ("slow",),
    "happy": ("sad", "unhappy"),
    "up": ("down",),
    "early": ("late",),
    "full": ("empty",),
    "open": ("closed", "close", "shut"),
    "rich": ("poor",),
    "strong": ("weak",),
    "tall": ("short",),
    "wet": ("dry",),
    "loud": ("quiet", "soft", "silent"),
    "clean": ("dirty",),
    "day": ("night",),
    "win": ("lose",),
    "push": ("pull",),
    "buy": ("sell",),
    "first": ("last",),
    "thick": ("thin",),
    "inside": ("outside",),
    "left": ("right",),
    "black": ("white",),
    "good": ("bad", "evil"),
    "true": ("false",),
    "love": ("hate",),
    "begin": ("end", "finish", "stop"),
    "heavy": ("light",),
    "high": ("low",),
    "near": ("far",),
    "young": ("old",),
    "cheap": ("expensive", "costly"),
    "easy": ("hard", "difficult"),
    "friend": ("enemy", "foe"),
    "give": ("take", "receive"),
    "question": ("answer",),
    "remember": ("forget",),
    "safe": ("dangerous", "unsafe"),
    "smooth": ("rough",),
    "sweet": ("sour", "bitter"),
    "wide": ("narrow",),
    "above": ("below", "beneath", "under"),
    "accept": ("reject", "refuse", "decline"),
    "arrive": ("leave", "depart"),
    "asleep": ("awake",),
    "brave": ("cowardly", "afraid", "scared"),
    "north": ("south",),
    "east": ("west",),
    "morning": ("evening", "night"),
    "summer": ("winter",),
    "laugh": ("cry",),
    "alive": ("dead",),
    "always": ("never",),
    "entrance": ("exit",),
    "increase": ("decrease", "reduce"),
    "import": ("export",),
    "maximum": ("minimum",),
    "success": ("failure", "fail"),
    "victory": ("defeat", "loss"),
    "wild": ("tame", "domestic"),
}

PROMPT = 'What is the opposite of "{word}"? Answer with one word.'

_WORDS = re.compile(r"[a-z]+")
_ANSWERS = frozenset(answer for answers in PAIRS.values() for answer in answers)


@dataclass(frozen=True)
class Question:
    """One task instance; `key` groups attempts at it (sent as the call's `metadata.group_key`)."""

    key: str
    word: str
    answers: tuple[str, ...]

    @property
    def prompt(self) -> str:
        return PROMPT.format(word=self.word)


def questions() -> list[Question]:
    return [Question(f"opposite-{word}", word, answers) for word, answers in PAIRS.items()]


def reward(reply: str | None, question: Question) -> float:
    """1 when the reply gives an accepted opposite and no other candidate answer, else 0."""
    named = {word for word in _WORDS.findall((reply or "").lower()) if word in _ANSWERS}
    named.discard(question.word)  # "the opposite of hot is cold" repeats the question's word
    return 1.0 if named and named <= set(question.answers) else 0.0


_BY_PROMPT = {q.prompt: q for q in questions()}


def score(trajectory: dict[str, Any]) -> float:
    """The policy's reward function for trajectories nobody gave feedback for (training, the gate)."""
    messages = trajectory.get("messages") or []
    user = next((m for m in messages if m.get("role") == "user"), None)
    question = _BY_PROMPT.get(str(user.get("content"))) if user else None
    if question is None:
        raise ValueError("not a demo task: the first user message is not one of the demo prompts")
    last = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
    return reward(last.get("content") if last else None, question)
