"""Trajectories and groups of them, as the code that runs rollouts sees them.

A `Trajectory` is a handle on one episode the gateway captures: every call made through its OpenAI client (or
with its `headers`, e.g. a LangChain/LangGraph chat model) joins that episode, and carries its group key, so the
gateway groups attempts at the same scenario for RULER and GRPO. Its reward is set in code and sent as
feedback. The conversation itself is never rebuilt here: the gateway stored it, with the exact tokens sampled.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gateway.client.connection import Connection

if TYPE_CHECKING:
    import openai

EPISODE_HEADER = "X-Episode-Id"
GROUP_HEADER = "X-Kaizen-Group-Key"


@dataclass(eq=False)
class Trajectory:
    """One rollout: its episode id (chosen here, so it is known before the first call), group, and reward."""

    connection: Connection
    model: str
    group_key: str | None = None
    episode_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    #: Set by the rollout; sent as feedback by `Model.send_rewards`. None: left to a scorer (RULER).
    reward: float | None = None
    #: Numbers worth keeping with the reward (stored as the feedback's metadata), e.g. turns or tool errors.
    metrics: dict[str, float] = field(default_factory=dict)
    #: What the rollout raised, when it failed (`gather` keeps failed rollouts out of their group).
    error: BaseException | None = None

    @property
    def headers(self) -> dict[str, str]:
        """Headers that put a call into this trajectory's episode and group (for any OpenAI-compatible client)."""
        headers = {EPISODE_HEADER: self.episode_id}
        if self.group_key is not None:
            headers[GROUP_HEADER] = self.group_key
        return headers

    def openai_client(self, **options: Any) -> openai.OpenAI:
        """An `openai.OpenAI` client whose calls go through the gateway into this trajectory."""
        import openai

        return openai.OpenAI(**self._client_options(options))

    def async_openai_client(self, **options: Any) -> openai.AsyncOpenAI:
        """An `openai.AsyncOpenAI` client whose calls go through the gateway into this trajectory."""
        import openai

        return openai.AsyncOpenAI(**self._client_options(options))

    def _client_options(self, options: dict[str, Any]) -> dict[str, Any]:
        headers = {**self.headers, **(options.pop("default_headers", None) or {})}
        return {
            "base_url": self.connection.openai_base_url,
            "api_key": self.connection.api_key or "unused",
            "default_headers": headers,
            **options,
        }

    def feedback(self, name: str) -> dict[str, Any] | None:
        """This trajectory's reward as a `/v1/feedback` item (idempotent: sending it twice stores it once)."""
        if self.reward is None or self.error is not None:
            return None
        if not math.isfinite(self.reward):
            raise ValueError(f"trajectory {self.episode_id}: the reward must be a finite number")
        item: dict[str, Any] = {
            "episode_id": self.episode_id,
            "value": float(self.reward),
            "name": name,
            "idempotency_key": f"{name}:{self.episode_id}",
        }
        if self.metrics:
            item["metadata"] = dict(self.metrics)
        return item


@dataclass(eq=False)
class TrajectoryGroup:
    """Attempts at one scenario: they share a group key, so they are judged and trained as a group."""

    key: str
    scenario: Any
    trajectories: list[Trajectory] = field(default_factory=list)
    #: Rollouts that raised; kept out of `trajectories`.
    failures: list[Trajectory] = field(default_factory=list)

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories if t.reward is not None]
