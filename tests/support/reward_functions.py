"""Reward functions that tests name by import path in a policy's scorer configuration."""

from __future__ import annotations

from typing import Any


def length_score(trajectory: dict[str, Any]) -> dict[str, Any]:
    """0.5 for replies up to 10 characters, else 0.0: simple enough to assert exactly."""
    reply = trajectory["messages"][-1]["content"]
    return {"score": 0.5 if len(reply) <= 10 else 0.0, "explanation": f"{len(reply)} characters"}
