"""Scoring trajectories nobody gives feedback for (training rollouts, the evaluation gate, live traffic).

A policy names its scorer; the first one configured wins: a reward function (`module:function`, called with
the trajectory dict, returning a number or `{"score": x, "explanation": "..."}`), a scoring webhook (Kaizen
POSTs `{"trajectory": {...}}` signed like feedback webhooks and reads back the same shape), or RULER.
Every scorer answers for a whole group and never raises for a scoring failure: the outcome carries the error.

The scoring webhook is the user's service, not the gateway: Kaizen asks it for a score and writes the answer
through `storage` itself, so nothing here posts rewards back over HTTP. Its requests carry the feedback
webhook's signature format (`X-Kaizen-Signature: t=<unix s>,v1=<hex HMAC-SHA256 of "<t>.<body>">`) so that a
user verifies both with one routine. Verifying signatures is the gateway's job (`gateway/signing.py`); the
trainer must not import the gateway, so `webhook_signature` below is the few lines the trainer needs to sign.

The webhook and a judge whose `api_base` the policy names are reached only at global addresses unless the operator
opts in (`trainer.control.outbound`): checked before each group is scored, and again where the request connects.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import importlib
import inspect
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import httpx
import msgspec

from storage.episodes import EpisodeTranscript
from trainer.control.outbound import OutboundRefused, address_problem, policy_client
from trainer.control.policy_config import RewardConfig
from trainer.control.ruler import (
    Complete,
    Completion,
    JudgeSettings,
    PolicyJudge,
    judge_group,
    litellm_complete,
)

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Kaizen-Signature"


def webhook_signature(secret: str, body: bytes) -> str:
    """The signature header value of an outgoing scoring request, signed now."""
    timestamp = str(int(time.time()))
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


@dataclass(frozen=True)
class Score:
    episode_id: str
    value: float
    explanation: str | None


@dataclass(frozen=True)
class GroupScore:
    source: str  # the rewards.source of the scores: function | webhook | judge
    name: str  # the rewards.name: the function path, `webhook`, or `ruler`
    model: str | None
    scores: list[Score] | None
    error: str | None = None
    attempts: int = 1
    latency_ms: float | None = None
    cost_usd: float | None = None


class ScoringError(ValueError):
    pass


def _read_score(answer: Any) -> tuple[float, str | None]:
    if isinstance(answer, dict):
        value = answer.get("score", answer.get("value"))
        explanation = answer.get("explanation")
    else:
        value, explanation = answer, None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ScoringError(f"a score must be a finite number, got {value!r}")
    return float(value), str(explanation) if explanation is not None else None


def load_function(path: str) -> Callable[..., Any]:
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ScoringError(f"reward function must be `module:function`, got {path!r}")
    function = getattr(importlib.import_module(module_name), attribute, None)
    if not callable(function):
        raise ScoringError(f"{path!r} is not a callable")
    return function  # type: ignore[no-any-return]


class Scorer:
    """Scores groups of trajectories with the policy's configured method.

    A judge at a URL the policy names, and a scoring webhook, are each called through one client for the scorer's
    lifetime (connections kept from group to group): use it as `async with Scorer(...) as scorer:`, or call
    `aclose` when done. `complete` replaces litellm (tests)."""

    def __init__(
        self,
        config: RewardConfig,
        judge: JudgeSettings,
        *,
        webhook_secret: str = "",
        complete: Complete | None = None,
    ) -> None:
        self.config = config
        self.kind = config.scorer.kind
        self.judge = replace(
            judge,
            model=config.judge.model or judge.model,
            api_base=config.judge.api_base or judge.api_base,
            policy_api_base=bool(config.judge.api_base),
        )
        self.webhook_secret = webhook_secret
        self.complete = complete if complete is not None else self._litellm
        self._warned_unsigned = False
        # No client until the first call (the OpenAI client comes with litellm).
        self._policy_judge = PolicyJudge(self.judge) if self.judge.policy_api_base else None
        self._webhook_client: httpx.AsyncClient | None = None

    async def __aenter__(self) -> Scorer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the clients of the policy's judge and of its webhook, if they were opened."""
        if self._policy_judge is not None:
            await self._policy_judge.aclose()
        if self._webhook_client is not None:
            client, self._webhook_client = self._webhook_client, None
            await client.aclose()

    async def _litellm(
        self, messages: list[dict[str, Any]], fmt: dict[str, Any], settings: JudgeSettings
    ) -> Completion:
        return await litellm_complete(messages, fmt, settings, policy_judge=self._policy_judge)

    @property
    def source(self) -> str:
        return self.kind

    @property
    def min_group_size(self) -> int:
        """RULER compares: a group needs several attempts. Other scorers score one trajectory at a time."""
        return self.config.scorer.min_group_size if self.kind == "judge" else 1

    async def score(self, trajectories: Sequence[EpisodeTranscript]) -> GroupScore:
        if self.kind == "judge":
            return await self._ruler(trajectories)
        started = time.perf_counter()
        name = self.config.scorer.function or "webhook"
        try:
            if self.kind == "function":
                scores = await self._function(trajectories)
            else:
                scores = await self._webhook(trajectories)
        except Exception as exc:  # a user's function or server failing must not stop the batch
            return GroupScore(self.kind, name, None, None, f"{type(exc).__name__}: {exc}"[:2000])
        return GroupScore(self.kind, name, None, scores, latency_ms=(time.perf_counter() - started) * 1000)

    async def _refused(self, url: str) -> str | None:
        """Why a URL the policy names may not be called now (checked before a group is sent; the pinned client
        checks the address it connects to again), or None. A name that does not resolve is left to the call."""
        if self.judge.private_networks:
            return None
        try:
            return await address_problem(url)
        except OSError:
            return None

    async def _ruler(self, trajectories: Sequence[EpisodeTranscript]) -> GroupScore:
        if not self.judge.model:
            return GroupScore("judge", "ruler", None, None, "no judge model: set KAIZEN_JUDGE_MODEL")
        if self.judge.policy_api_base and self.judge.api_base:
            refused = await self._refused(self.judge.api_base)
            if refused is not None:
                log.warning("judge of the policy not called: %s", refused)
                return GroupScore("judge", "ruler", self.judge.model, None, f"judge not called: {refused}")
        outcome = await judge_group(
            [t.messages for t in trajectories],
            [t.episode_id for t in trajectories],
            self.config.judge.rubric,
            self.judge,
            self.complete,
        )
        scores = (
            [Score(j.trajectory_id, j.score, j.explanation) for j in outcome.judgements]
            if outcome.judgements is not None
            else None
        )
        return GroupScore(
            "judge",
            "ruler",
            outcome.model,
            scores,
            outcome.error,
            outcome.attempts,
            outcome.latency_ms,
            outcome.cost_usd,
        )

    async def _function(self, trajectories: Sequence[EpisodeTranscript]) -> list[Score]:
        function = load_function(self.config.scorer.function or "")
        scores = []
        for trajectory in trajectories:
            answer = function(trajectory.as_dict())
            if inspect.isawaitable(answer):
                answer = await answer
            value, explanation = _read_score(answer)
            scores.append(Score(trajectory.episode_id, value, explanation))
        return scores

    async def _webhook(self, trajectories: Sequence[EpisodeTranscript]) -> list[Score]:
        scorer = self.config.scorer
        url = scorer.webhook_url or ""
        refused = await self._refused(url)
        if refused is not None:
            raise OutboundRefused(refused)
        if not self.webhook_secret and not self._warned_unsigned:
            self._warned_unsigned = True
            log.warning(
                "scoring webhook %s is called unsigned: set KAIZEN_FEEDBACK_SECRET so it can tell Kaizen's "
                "requests from anyone else's",
                url,
            )
        if self._webhook_client is None:
            self._webhook_client = policy_client(
                private_networks=self.judge.private_networks, timeout=scorer.webhook_timeout_s
            )
        scores = []
        for trajectory in trajectories:
            body = msgspec.json.encode({"trajectory": trajectory.as_dict()})
            answer = await self._post(self._webhook_client, url, body, scorer.webhook_retries)
            value, explanation = _read_score(answer)
            scores.append(Score(trajectory.episode_id, value, explanation))
        return scores

    async def _post(self, client: httpx.AsyncClient, url: str, body: bytes, retries: int) -> Any:
        error: Exception | None = None
        for attempt in range(retries + 1):
            if attempt:
                await asyncio.sleep(0.5 * 2 ** (attempt - 1))
            headers = {"content-type": "application/json"}
            if self.webhook_secret:
                headers[SIGNATURE_HEADER] = webhook_signature(
                    self.webhook_secret, body
                )  # re-signed: the timestamp stays fresh
            try:
                response = await client.post(url, content=body, headers=headers)
                if response.status_code < 500:
                    response.raise_for_status()
                    return response.json()
                error = ScoringError(f"scoring webhook answered {response.status_code}")
            except (httpx.TransportError, ValueError) as exc:
                error = exc
        raise ScoringError(f"scoring webhook failed after {retries + 1} attempts: {error}")
