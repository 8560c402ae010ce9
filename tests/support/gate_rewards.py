"""A deterministic reward function for the evaluation-gate tests (named by import path in a policy config)."""

from __future__ import annotations

import re
from typing import Any

COLOUR = re.compile(r"\b(red|orange|yellow|green|blue|indigo|violet|purple)\b", re.IGNORECASE)


def rainbow(trajectory: dict[str, Any]) -> float:
    """1.0 when the reply names a colour of the rainbow as a word, else 0.0."""
    reply = trajectory["messages"][-1].get("content") or ""
    return 1.0 if COLOUR.search(reply) else 0.0
