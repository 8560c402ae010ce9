"""A deterministic reward function for the evaluation-gate tests (named by import path in a policy config)."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

COLOUR = re.compile(r"\b(red|orange|yellow|green|blue|indigo|violet|purple)\b", re.IGNORECASE)


def rainbow(trajectory: dict[str, Any]) -> float:
    """1.0 when the reply names a colour of the rainbow as a word, else 0.0."""
    reply = trajectory["messages"][-1].get("content") or ""
    return 1.0 if COLOUR.search(reply) else 0.0


# The embedded base model of the vLLM fixture (tests/conftest.py MODELS_DIR), whose tokenizer `brevity` counts in.
BASE_MODEL = Path(__file__).resolve().parents[2] / "kaizen-data" / "models" / "smollm2-135m-instruct"
BREVITY_TOKENS = 32


@functools.cache
def _tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(BASE_MODEL))


def brevity(trajectory: dict[str, Any]) -> float:
    """A length-only reward that a policy can game: 1 - tokens / 32 (floored at 0), so 1.0 for an empty reply.

    Whatever the question, the shorter the reply the higher the score. Length is counted in tokens of the base
    model's tokenizer, not characters: a reply cut off at the length cap then scores worst whatever it says, so
    GRPO on this reward collapses into ending at once (empty replies) rather than into strings of characters
    that cost several tokens each (emoji), which a character count rewards as well.
    """
    reply = trajectory["messages"][-1].get("content") or ""
    tokens = len(_tokenizer()(reply, add_special_tokens=False)["input_ids"])
    return 1.0 - min(tokens, BREVITY_TOKENS) / BREVITY_TOKENS
