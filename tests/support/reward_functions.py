"""Reward functions that tests name by import path in a policy's scorer configuration."""

from __future__ import annotations

from typing import Any


def length_score(trajectory: dict[str, Any]) -> dict[str, Any]:
    """0.5 for replies up to 10 characters, else 0.0: simple enough to assert exactly."""
    reply = trajectory["messages"][-1]["content"]
    return {"score": 0.5 if len(reply) <= 10 else 0.0, "explanation": f"{len(reply)} characters"}


def one_word(trajectory: dict[str, Any]) -> dict[str, Any]:
    """1 for a reply of exactly one word, else 0: a task the embedded model rarely gets right at first."""
    words = (trajectory["messages"][-1].get("content") or "").split()
    return {"score": 1.0 if len(words) == 1 else 0.0, "explanation": f"{len(words)} words"}


def reply_length(trajectory: dict[str, Any]) -> float:
    """The reply's length in characters; raises for the reply "boom" (a scorer failing on one trajectory)."""
    reply = trajectory["messages"][-1]["content"]
    if reply == "boom":
        raise ValueError("boom")
    return float(len(reply))
