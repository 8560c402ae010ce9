"""Resampling through the serving engine: the k-1 extra replies of a `resample` group come from the active
adapter as vLLM serves it, with the engine's own token ids and behaviour logprobs.

Replies are requested from the gateway's OpenAI URL as ``policy@N`` with ``X-Kaizen-No-Log`` (they are not user
traffic), ``logprobs`` and vLLM's ``return_tokens_as_token_ids``, which spells every sampled token as
``"token_id:<id>"`` in ``choices[].logprobs.content[].token``: the exact ids sampled, so a reply is never
re-tokenised. The context's ids come from the chat template (the gateway does not return prompt ids).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import httpx

from trainer.control.gateway_requests import (
    ENGINE_RESTART_WAIT_S,
    EngineSamplingError,
    gateway_headers,
    post_completion,
)
from trainer.control.rollouts import SampledTurn, reply_limit, request_options
from trainer.learner.tokens import prompt_ids

logger = logging.getLogger(__name__)

_TOKEN_PREFIX = "token_id:"


@dataclass(frozen=True)
class EngineEndpoint:
    """Where the trainer samples resampled replies: the gateway's OpenAI URL (ending in /v1) and its API key."""

    base_url: str
    api_key: str | None = None
    #: The gateway's `max_n`: larger groups are requested in several calls.
    max_n: int = 16
    request_timeout_s: float = 600.0
    #: How long 404/503 answers and lost connections are retried before the run fails.
    wait_s: float = ENGINE_RESTART_WAIT_S

    def sampler(self, model: str, tokenizer: Any, *, max_tokens: int, temperature: float) -> EngineSampler:
        return EngineSampler(self, model, tokenizer, max_tokens=max_tokens, temperature=temperature)


def parse_choices(response: dict[str, Any], prompt: list[int]) -> list[SampledTurn]:
    """One turn per choice of a chat completion requested with `return_tokens_as_token_ids`: its message (text
    and tool calls, as an app would get them), why it ended, and its exact token ids and logprobs."""
    samples = []
    for choice in response.get("choices") or []:
        entries = (choice.get("logprobs") or {}).get("content")
        if not isinstance(entries, list):
            raise EngineSamplingError("the engine returned a choice without logprobs")
        ids: list[int] = []
        logprobs: list[float] = []
        for entry in entries:
            token, logprob = str(entry.get("token", "")), entry.get("logprob")
            if not token.startswith(_TOKEN_PREFIX):
                raise EngineSamplingError(
                    f"the engine returned the token {token!r} instead of `token_id:<id>`: it does not support "
                    "`return_tokens_as_token_ids` (a vLLM engine is needed to resample through the gateway)"
                )
            if isinstance(logprob, bool) or not isinstance(logprob, int | float) or math.isnan(logprob):
                raise EngineSamplingError(f"the engine returned the logprob {logprob!r} for {token}")
            ids.append(int(token.removeprefix(_TOKEN_PREFIX)))
            logprobs.append(max(float(logprob), -9999.0))  # vLLM's own stand-in for -inf
        served = choice.get("message") or {}
        content = served.get("content")
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content if isinstance(content, str) else None,
        }
        if served.get("tool_calls"):
            message["tool_calls"] = served["tool_calls"]
        samples.append(
            SampledTurn(
                message=message,
                finish_reason=choice.get("finish_reason"),
                prompt_token_ids=prompt,
                token_ids=ids,
                logprobs=logprobs,
            )
        )
    return samples


class EngineSampler:
    """Implements `trainer.learner.grouping.Sampler` against the serving engine."""

    #: The engine batches concurrent requests; `TrainConfig.resample_concurrency` sets the actual limit.
    max_concurrency = 64

    def __init__(
        self, endpoint: EngineEndpoint, model: str, tokenizer: Any, *, max_tokens: int, temperature: float
    ) -> None:
        self.endpoint = endpoint
        self.url = endpoint.base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.headers = gateway_headers(endpoint.api_key)
        self._template_checked = False

    async def sample(
        self,
        messages: list[dict[str, Any]],
        tools: list[Any] | None,
        n: int,
        options: Mapping[str, Any] | None = None,
    ) -> list[SampledTurn]:
        """`n` turns answering `messages`, with the captured call's `options` (`tool_choice`, ...) repeated."""
        prompt = prompt_ids(self.tokenizer, messages, tools)
        limit, app_limit = reply_limit(options or {}, self.max_tokens)
        samples: list[SampledTurn] = []
        timeout = httpx.Timeout(self.endpoint.request_timeout_s, connect=10.0)
        async with httpx.AsyncClient(timeout=timeout) as client:
            while len(samples) < n:
                body: dict[str, Any] = {
                    "model": self.model,
                    "messages": messages,
                    "n": min(n - len(samples), self.endpoint.max_n),
                    "max_tokens": limit,
                    "temperature": self.temperature,
                    "logprobs": True,
                    "return_tokens_as_token_ids": True,
                }
                if tools:
                    body["tools"] = tools
                    body.update(request_options(options or {}))
                elif options and options.get("response_format") is not None:
                    body["response_format"] = options["response_format"]
                response = await post_completion(
                    client,
                    self.url,
                    body,
                    self.headers,
                    self.endpoint.wait_s,
                    " Set KAIZEN_TRAIN_SAMPLER=local to sample with the trainer's own copy of the adapter "
                    "instead.",
                )
                self._check_template(response, prompt)
                samples.extend(replace(s, app_limit=app_limit) for s in parse_choices(response, prompt))
        return samples

    def _check_template(self, response: dict[str, Any], prompt: list[int]) -> None:
        """Warn once when the engine counted another prompt length: its chat template differs from the
        tokenizer's (e.g. KAIZEN_VLLM_CHAT_TEMPLATE), so the trained context is not the one sampled from."""
        served = (response.get("usage") or {}).get("prompt_tokens")
        if self._template_checked or not isinstance(served, int):
            return
        self._template_checked = True
        if served != len(prompt):
            logger.warning(
                "the engine's prompt for %s has %d tokens, the tokenizer's chat template gives %d: resampled "
                "replies are trained on a context that differs from the one they were sampled from",
                self.model,
                served,
                len(prompt),
            )
