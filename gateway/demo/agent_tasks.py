"""The demo's agent task: a question only a tool can answer, an episode of several calls, one reward at the end.

`lockers`: "What is the secret word in locker 42?". Sixty lockers hold made-up secret words, so no model knows
them: the agent must call `open_locker` with the right number, read the result, and answer with the word it
found. The result first names the word the locker held before, another of the task's words: an answer that
repeats the whole result names two candidates and scores 0 (the demo's no-hedging rule), and one that takes the
first word it reads is wrong, so the agent must read the right field. The app forces the first turn to call a tool (`tool_choice: required`), as apps that always
look something up do; the embedded model then calls it, but with the right number and answering with the right
word only now and then (base rates in docs/training.md, the demo section).

`open_locker` is also the policy's tool (`tools.functions`), so the trainer can roll an episode out again with it,
and `score` is the policy's reward function for trajectories nobody gave feedback for. This module imports
nothing but the standard library: it runs in the gateway, the trainer and any checkout a benchmark starts.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Any

SECRETS: tuple[str, ...] = tuple(
    [
        "apple",
        "banana",
        "cherry",
        "lemon",
        "mango",
        "melon",
        "peach",
        "grape",
        "olive",
        "onion",
        "tiger",
        "zebra",
        "horse",
        "eagle",
        "otter",
        "panda",
        "koala",
        "camel",
        "llama",
        "shark",
        "piano",
        "violin",
        "guitar",
        "drum",
        "flute",
        "trumpet",
        "harp",
        "banjo",
        "cello",
        "organ",
        "river",
        "ocean",
        "desert",
        "forest",
        "island",
        "valley",
        "canyon",
        "meadow",
        "glacier",
        "volcano",
        "silver",
        "copper",
        "marble",
        "velvet",
        "cotton",
        "amber",
        "coral",
        "ivory",
        "pearl",
        "ruby",
        "rocket",
        "castle",
        "bridge",
        "tunnel",
        "garden",
        "candle",
        "mirror",
        "ladder",
        "basket",
        "pillow",
    ]
)
TOOL_NAME = "open_locker"
TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Open a locker and read the secret word kept inside it.",
        "parameters": {
            "type": "object",
            "properties": {"number": {"type": "integer", "description": "the locker number"}},
            "required": ["number"],
        },
    },
}
_WORDS = re.compile(r"[a-z]+")


@dataclass(frozen=True)
class Locker:
    """One question: the locker to open, what it holds now and held before."""

    key: str
    number: int
    word: str
    previous: str
    prompt: str


def _lockers() -> dict[int, Locker]:
    rng = random.Random(7)
    numbers = rng.sample(range(10, 100), len(SECRETS))
    words = rng.sample(SECRETS, len(SECRETS))
    lockers = {}
    for number, word in zip(numbers, words, strict=True):
        previous = SECRETS[(SECRETS.index(word) + 17) % len(SECRETS)]
        prompt = f"What is the secret word in locker {number}? Open it, then answer with one word."
        lockers[number] = Locker(f"locker-{number}", number, word, previous, prompt)
    return lockers


LOCKERS = _lockers()
_BY_PROMPT = {locker.prompt: locker for locker in LOCKERS.values()}


def open_locker(number: int) -> str:
    """Open a locker and read the secret word kept inside it."""
    locker = LOCKERS.get(int(number))
    if locker is None:
        return json.dumps({"error": f"there is no locker {number}"})
    # The earlier word comes first: an agent that copies the first word it reads gets it wrong.
    return json.dumps({"locker": locker.number, "previous_word": locker.previous, "secret_word": locker.word})


def reward(answer: str | None, locker: Locker) -> float:
    """1 when the answer names the locker's secret word and no other word of the task, else 0."""
    named = {word for word in _WORDS.findall((answer or "").lower()) if word in SECRETS}
    return 1.0 if named == {locker.word} else 0.0


def right_call(arguments: str, locker: Locker) -> bool:
    """Whether a tool call's arguments open the question's locker."""
    try:
        parsed = json.loads(arguments)
        return isinstance(parsed, dict) and int(parsed["number"]) == locker.number
    except (ValueError, TypeError, KeyError):
        return False


def score(trajectory: dict[str, Any]) -> float:
    """The policy's reward function: the final answer of the episode, whatever it did on the way."""
    messages = trajectory.get("messages") or []
    user = next((m for m in messages if m.get("role") == "user"), None)
    locker = _BY_PROMPT.get(str(user.get("content"))) if user else None
    if locker is None:
        raise ValueError(
            "not a demo locker question: the first user message is not one of the task's prompts"
        )
    last = messages[-1] if messages else {}
    if last.get("role") != "assistant" or last.get("tool_calls"):
        return 0.0  # it never answered: still calling tools when the episode ended
    return reward(last.get("content"), locker)


@dataclass(frozen=True)
class AgentTask:
    """An agent task of the demo: its questions, the tool its app offers, and what the demo should reach."""

    name: str
    tool: dict[str, Any]
    #: The policy's tool (`tools.functions`) that answers the app's tool: the trainer runs it in rollouts.
    tool_path: str
    #: The app's `tool_choice` on an episode's first turn (later turns are `auto`).
    first_tool_choice: str
    target_reward: float
    target_minutes: float
    #: Tokens the agent may use per turn: a tool call takes about 30 of the embedded model's.
    max_tokens: int = 48
    max_turns: int = 3

    def questions(self) -> list[Locker]:
        return list(LOCKERS.values())


LOCKER_TASK = AgentTask(
    "lockers",
    TOOL,
    "gateway.demo.agent_tasks:open_locker",
    "required",
    target_reward=0.5,
    target_minutes=30,
)
AGENT_TASKS: dict[str, AgentTask] = {LOCKER_TASK.name: LOCKER_TASK}
