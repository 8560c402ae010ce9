"""The demo's verifiable tasks: questions with a one-word answer, checked for content rather than format.

Each task asks one question per word and accepts only that word's answers, so a constant reply is right for at
most one question in sixty, an empty reply or one that ignores the question scores 0, and a reply that names
several candidate answers to cover its bets scores 0 too. A model that learned a task still gives a different
reply to every question: the share of distinct replies stays high unless the policy collapses.

* `opposites` (the default): "What is the opposite of "hot"?". The embedded base model knows many of these
  pairs but says so unreliably at temperature 1, so training has reward variance from the first cycle.
* `past-tense`: "What is the past tense of "go"?", irregular verbs only. The base model rarely says the form
  within the reply's few tokens at temperature 1 (base rates in docs/training.md): successes are rare, and
  most groups of replies to one question have no reward variance at first.

This module imports nothing but the standard library: the policy's reward function (`score`) runs in the
gateway, the trainer and any checkout a benchmark starts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

OPPOSITES: dict[str, tuple[str, ...]] = {
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

#: Irregular verbs whose past tense differs from the verb and from every other answer here; common past forms
#: that replies use as ordinary words ("had", "did", "made", "said", "got") are left out.
PAST_TENSE: dict[str, tuple[str, ...]] = {
    "go": ("went",),
    "run": ("ran",),
    "eat": ("ate",),
    "see": ("saw",),
    "take": ("took",),
    "give": ("gave",),
    "write": ("wrote",),
    "drive": ("drove",),
    "speak": ("spoke",),
    "break": ("broke",),
    "choose": ("chose",),
    "freeze": ("froze",),
    "fly": ("flew",),
    "grow": ("grew",),
    "know": ("knew",),
    "throw": ("threw",),
    "swim": ("swam",),
    "sing": ("sang",),
    "drink": ("drank",),
    "begin": ("began",),
    "buy": ("bought",),
    "bring": ("brought",),
    "think": ("thought",),
    "catch": ("caught",),
    "teach": ("taught",),
    "sell": ("sold",),
    "tell": ("told",),
    "find": ("found",),
    "sleep": ("slept",),
    "build": ("built",),
    "come": ("came",),
    "forget": ("forgot",),
    "fall": ("fell",),
    "feel": ("felt",),
    "keep": ("kept",),
    "leave": ("left",),
    "meet": ("met",),
    "lose": ("lost",),
    "send": ("sent",),
    "spend": ("spent",),
    "stand": ("stood",),
    "sit": ("sat",),
    "win": ("won",),
    "hold": ("held",),
    "hear": ("heard",),
    "ride": ("rode",),
    "rise": ("rose",),
    "shake": ("shook",),
    "steal": ("stole",),
    "wake": ("woke",),
    "wear": ("wore",),
    "bite": ("bit",),
    "hide": ("hid",),
    "fight": ("fought",),
    "dig": ("dug",),
    "lead": ("led",),
    "feed": ("fed",),
    "blow": ("blew",),
    "draw": ("drew",),
    "ring": ("rang",),
}

_WORDS = re.compile(r"[a-z]+")


@dataclass(frozen=True)
class Question:
    """One task instance; `key` groups attempts at it (sent as the call's `metadata.group_key`)."""

    key: str
    word: str
    answers: tuple[str, ...]
    prompt: str
    #: Every answer of the task: naming one that is not this question's is a wrong (or hedged) reply.
    candidates: frozenset[str]


@dataclass(frozen=True)
class Task:
    """A set of questions with one-word answers, and what the demo should reach on it."""

    name: str
    #: Question keys are `<key_prefix>-<word>`.
    key_prefix: str
    #: The prompt, with `{word}` for the question's word.
    template: str
    answers: dict[str, tuple[str, ...]]
    #: Live reward the demo's summary checks for, and within how many minutes of traffic.
    target_reward: float
    target_minutes: float

    def questions(self) -> list[Question]:
        candidates = frozenset(a for answers in self.answers.values() for a in answers)
        return [
            Question(f"{self.key_prefix}-{word}", word, answers, self.template.format(word=word), candidates)
            for word, answers in self.answers.items()
        ]


TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        Task(
            "opposites",
            "opposite",
            'What is the opposite of "{word}"? Answer with one word.',
            OPPOSITES,
            0.8,
            20,
        ),
        Task(
            "past-tense",
            "past",
            'What is the past tense of "{word}"? Answer with one word.',
            PAST_TENSE,
            0.5,
            30,
        ),
    )
}


def reward(reply: str | None, question: Question) -> float:
    """1 when the reply gives an accepted answer and no other candidate answer, else 0."""
    named = {word for word in _WORDS.findall((reply or "").lower()) if word in question.candidates}
    named.discard(question.word)  # "the opposite of hot is cold" repeats the question's word
    return 1.0 if named and named <= set(question.answers) else 0.0


_BY_PROMPT = {q.prompt: q for task in TASKS.values() for q in task.questions()}


def score(trajectory: dict[str, Any]) -> float:
    """The policy's reward function for trajectories nobody gave feedback for (training, the gate)."""
    messages = trajectory.get("messages") or []
    user = next((m for m in messages if m.get("role") == "user"), None)
    question = _BY_PROMPT.get(str(user.get("content"))) if user else None
    if question is None:
        raise ValueError("not a demo task: the first user message is not one of the demo prompts")
    last = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
    return reward(last.get("content") if last else None, question)
