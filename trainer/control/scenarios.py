"""Training scenarios for a task nobody has sent traffic for yet (a cold start, as in AutoRL): a model writes
varied first user messages from a plain-English description of the task.

The writer is any litellm model or OpenAI-compatible URL, configured like RULER's judge (the gateway's own
engine included: its calls carry `X-Kaizen-No-Log`, so writing scenarios is not captured as traffic). It is
asked for a few scenarios at a time with a JSON schema, and shown the ones it wrote already so that later
batches differ; repeats (compared without case and spacing) are dropped and counted. Malformed answers and
failed calls are retried like the judge's. With `settings.seed` S, request k of the writer (retries counted)
is sent with seed S + k, so a rerun against an engine that honours `seed` writes the same scenarios.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from trainer.control.ruler import (
    Complete,
    JudgeSettings,
    MalformedAnswer,
    ask_json,
    json_object,
    litellm_complete,
    offset_seed,
)

logger = logging.getLogger(__name__)

SYSTEM_PROMPT = """\
You write test scenarios for an AI assistant. A scenario is the first message a real user of the assistant \
would send: self-contained, with every detail the assistant needs, written as that user would write it.
Make the scenarios diverse: different topics, difficulty, length, tone and phrasing, including unusual but \
realistic requests. Never repeat or paraphrase a scenario you were shown.

Answer with JSON only, in this shape:
{"scenarios": [{"message": "the user's first message"}]}"""

#: How many earlier scenarios the writer is shown (the newest): enough to steer away from repeats, while the
#: prompt stays short for small models.
SHOWN = 40
#: Rounds in a row that add nothing new before the writer is considered exhausted.
STALE_ROUNDS = 2
_SPACE = re.compile(r"\s+")


class ScenarioError(RuntimeError):
    """The writer could not produce scenarios (every attempt failed, or it wrote none that were new)."""


@dataclass(frozen=True)
class WrittenScenarios:
    """The scenarios (first user messages), and what writing them took."""

    messages: list[str]
    requests: int
    duplicates: int
    cost_usd: float | None


def answer_format(count: int) -> dict[str, Any]:
    """JSON schema of a batch, so engines with guided decoding can only produce a valid one."""
    return {
        "type": "json_schema",
        "json_schema": {
            "name": "scenarios",
            "strict": True,
            "schema": {
                "type": "object",
                "properties": {
                    "scenarios": {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": count,
                        "items": {
                            "type": "object",
                            "properties": {"message": {"type": "string", "minLength": 1, "maxLength": 2000}},
                            "required": ["message"],
                            "additionalProperties": False,
                        },
                    }
                },
                "required": ["scenarios"],
                "additionalProperties": False,
            },
        },
    }


def parse_scenarios(text: str) -> list[str]:
    """The non-empty messages of an answer (plain strings are accepted for entries). Raises `MalformedAnswer`."""
    data = json_object(text)
    entries = data.get("scenarios") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise MalformedAnswer("the answer has no `scenarios` list")
    messages = []
    for entry in entries:
        message = entry.get("message") if isinstance(entry, dict) else entry
        if isinstance(message, str) and message.strip():
            messages.append(message.strip())
    if not messages:
        raise MalformedAnswer("the answer has no scenario with a non-empty `message`")
    return messages


def tools_task(tools: Sequence[Mapping[str, Any]], task: str | None = None) -> str:
    """The task of an agent whose tools are `tools` (chat `tools` entries), for the writer: scenarios a user would
    bring to it that need those tools, without naming them (MCP•RL's cold start)."""
    lines = []
    for tool in tools:
        function = tool.get("function") or {}
        schema = json.dumps(function.get("parameters") or {}, sort_keys=True)
        lines.append(
            f"- {function.get('name')}: {function.get('description') or '(no description)'} {schema}"
        )
    described = (
        "An agent that answers users by calling these tools (name: description, JSON schema of its arguments):\n"
        + "\n".join(lines)
        + "\nEach scenario must need at least one of the tools (some need several calls), must be answerable "
        "from what the tools return, must not name the tools, and should ask for a short, checkable answer."
    )
    return f"{task.strip()}\n\n{described}" if task else described


def build_request(task: str, count: int, written: Sequence[str]) -> list[dict[str, str]]:
    """The writer's messages for one batch of `count` scenarios, after the ones `written` so far."""
    parts = [f"The assistant's task:\n{task.strip()}"]
    if written:
        shown = "\n".join(f"- {m}" for m in written[-SHOWN:])
        parts.append(f"Scenarios already written (write different ones):\n{shown}")
    parts.append(f"Write {count} new scenario{'s' if count != 1 else ''}.")
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "\n\n".join(parts)}]


def _key(message: str) -> str:
    return _SPACE.sub(" ", message).strip().casefold()


async def write_scenarios(
    task: str,
    count: int,
    settings: JudgeSettings,
    complete: Complete = litellm_complete,
    *,
    batch_size: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> WrittenScenarios:
    """`count` distinct scenarios for `task`, `batch_size` per request; fewer only if the writer runs dry.

    Raises `ScenarioError` when a request fails after its retries, or when no scenario at all was written.
    """
    if count < 1 or batch_size < 1:
        raise ValueError("count and batch_size must be at least 1")
    if not task.strip():
        raise ValueError("the task description is empty")
    messages: list[str] = []
    seen: set[str] = set()
    requests = duplicates = stale = 0
    cost: float | None = None
    while len(messages) < count and stale < STALE_ROUNDS:
        wanted = min(batch_size, count - len(messages))
        answer = await ask_json(
            build_request(task, wanted, messages),
            answer_format(wanted),
            replace(settings, seed=offset_seed(settings.seed, requests)),
            parse_scenarios,
            complete,
            what="scenario writer",
        )
        requests += answer.attempts
        if answer.cost_usd is not None:
            cost = (cost or 0.0) + answer.cost_usd
        if answer.value is None:
            raise ScenarioError(f"the scenario writer {settings.model} failed: {answer.error}")
        fresh = 0
        for message in answer.value[:wanted]:
            key = _key(message)
            if key in seen:
                duplicates += 1
                continue
            seen.add(key)
            messages.append(message)
            fresh += 1
        stale = 0 if fresh else stale + 1
        if progress is not None:
            progress(len(messages), count)
    if not messages:
        raise ScenarioError(f"the scenario writer {settings.model} wrote no usable scenario")
    if len(messages) < count:
        logger.warning("the scenario writer ran dry: %d of %d scenarios", len(messages), count)
    return WrittenScenarios(messages, requests, duplicates, cost)
