"""RULER: relative LLM-as-judge over a group of trajectories that attempt the same task.

The judge sees the shared context once and then each trajectory's differing part, with the policy's rubric,
and answers with structured JSON: a score in [0, 1] and a short explanation per trajectory. Comparing
attempts side by side is what makes the scores useful for GRPO, which only needs their relative order.

The judge is any litellm model string, or any OpenAI-compatible URL (a plain model name with an API base,
for example Kaizen's own gateway or engine, so judging runs offline on the embedded model). Malformed
answers, a wrong number of scores and failed calls are retried with backoff; after the last attempt the
outcome carries the error instead of scores, and the caller moves on to the next group.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any, Generic, TypeVar

import msgspec

from trainer.control.outbound import policy_client

log = logging.getLogger(__name__)

T = TypeVar("T")

SYSTEM_PROMPT = """\
You are an impartial judge. You compare several trajectories of an AI assistant that attempt the same task \
and score each one from 0 (worst) to 1 (best), relative to the others, following the rubric.

Rubric:
{rubric}

Answer with JSON only, exactly one entry per trajectory, in this shape:
{{"scores": [{{"trajectory_id": "t1", "explanation": "one or two sentences", "score": 0.0}}]}}"""

# Kaizen's gateway stores nothing of calls that carry this header: judging must not become training data.
NO_LOG_HEADERS = {"X-Kaizen-No-Log": "true"}
#: Seeds are signed 64-bit integers; seeds derived by adding an offset wrap to stay at or above 0.
SEED_SPACE = 2**63
_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$", re.S)


@dataclass(frozen=True)
class JudgeSettings:
    """Where and how to call the judge; built from the process settings and the policy's overrides."""

    model: str
    api_base: str | None = None
    api_key: str | None = None
    temperature: float = 0.0
    timeout_s: float = 120.0
    max_retries: int = 2
    concurrency: int = 4
    backoff_s: float = 1.0  # first pause between attempts; doubles each time
    max_tokens: int | None = None  # cap on the judge's answer (small local judges may ramble)
    # Sent as `seed` where the provider takes one; each retry adds 1 (the same seed would draw the same answer).
    seed: int | None = None
    # `api_base` is a policy's own (`rewards.judge.api_base`), not the operator's: it is called as an
    # OpenAI-compatible server through Kaizen's pinned client (`trainer.control.outbound`), not litellm's.
    policy_api_base: bool = False
    # URLs a policy names (its judge's, its scoring webhook's) may reach loopback, private and link-local
    # addresses (`KAIZEN_OUTBOUND_PRIVATE_NETWORKS`).
    private_networks: bool = False


@dataclass(frozen=True)
class Judgement:
    trajectory_id: str  # the caller's id (an episode id)
    score: float
    explanation: str


@dataclass(frozen=True)
class JudgeOutcome:
    model: str
    attempts: int
    latency_ms: float  # of the last attempt
    cost_usd: float | None  # summed over attempts when the provider's price is known
    judgements: list[Judgement] | None  # None when the group could not be judged
    error: str | None = None


class MalformedAnswer(ValueError):
    """A model answered, but not with the JSON it was asked for."""


class MalformedJudgement(MalformedAnswer):
    """The judge answered, but not with one valid score per trajectory."""


@dataclass(frozen=True)
class Completion:
    text: str
    cost_usd: float | None
    latency_ms: float  # of the call alone (not of importing the client library)


Complete = Callable[[list[dict[str, Any]], dict[str, Any], JudgeSettings], Awaitable[Completion]]


# ----------------------------------------------------------------------------- prompt
def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def render_message(message: Mapping[str, Any]) -> str:
    """One message as the judge reads it: role, text, tool calls and tool results."""
    role = str(message.get("role", "?"))
    parts = [_content_text(message.get("content"))]
    for call in message.get("tool_calls") or []:
        function = call.get("function", {}) if isinstance(call, dict) else {}
        parts.append(f"<tool_call name={function.get('name')!r}>{function.get('arguments', '')}</tool_call>")
    label = f"{role} (tool result)" if role == "tool" else role
    return f"[{label}]\n" + "\n".join(p for p in parts if p)


def shared_prefix_length(conversations: Sequence[Sequence[Mapping[str, Any]]]) -> int:
    """How many leading messages all conversations share, leaving every one at least one message of its own."""
    if not conversations:
        return 0
    limit = min(len(c) for c in conversations) - 1
    length = 0
    while length < limit and all(c[length] == conversations[0][length] for c in conversations[1:]):
        length += 1
    return max(length, 0)


def build_prompt(conversations: Sequence[Sequence[Mapping[str, Any]]], rubric: str) -> list[dict[str, str]]:
    """The judge's messages: rubric and output format, then the shared context once and each trajectory's rest."""
    shared = shared_prefix_length(conversations)
    blocks = []
    if shared:
        context = "\n\n".join(render_message(m) for m in conversations[0][:shared])
        blocks.append(f"<shared_context>\n{context}\n</shared_context>")
    for index, conversation in enumerate(conversations, start=1):
        body = "\n\n".join(render_message(m) for m in conversation[shared:])
        blocks.append(f'<trajectory id="t{index}">\n{body}\n</trajectory>')
    ids = ", ".join(f"t{i}" for i in range(1, len(conversations) + 1))
    blocks.append(f"Score each of the {len(conversations)} trajectories ({ids}) against the rubric.")
    return [
        {"role": "system", "content": SYSTEM_PROMPT.format(rubric=rubric.strip())},
        {"role": "user", "content": "\n\n".join(blocks)},
    ]


def response_format(count: int) -> dict[str, Any]:
    """JSON schema of the answer, so engines with guided decoding can only produce a valid one."""
    ids = [f"t{i}" for i in range(1, count + 1)]
    return {
        "type": "json_schema",
        "json_schema": {
            "name": "ruler_scores",
            "strict": True,
            "schema": {
                "type": "object",
                "properties": {
                    "scores": {
                        "type": "array",
                        "minItems": count,
                        "maxItems": count,
                        "items": {
                            "type": "object",
                            "properties": {
                                "trajectory_id": {"type": "string", "enum": ids},
                                "explanation": {"type": "string", "maxLength": 300},
                                "score": {"type": "number", "minimum": 0, "maximum": 1},
                            },
                            "required": ["trajectory_id", "explanation", "score"],
                            "additionalProperties": False,
                        },
                    }
                },
                "required": ["scores"],
                "additionalProperties": False,
            },
        },
    }


# ----------------------------------------------------------------------------- parsing
def json_object(text: str, error: type[MalformedAnswer] = MalformedAnswer) -> Any:
    """The JSON object in a model's answer, leniently: code fences and text around the braces are ignored."""
    cleaned = _FENCE.sub("", text.strip())
    start, end = cleaned.find("{"), cleaned.rfind("}")
    if start < 0 or end < start:
        raise error(f"no JSON object in the answer: {text[:200]!r}")
    try:
        return msgspec.json.decode(cleaned[start : end + 1])
    except msgspec.DecodeError as exc:
        raise error(f"the answer is not valid JSON: {exc}") from exc


def parse_scores(text: str, count: int) -> list[tuple[float, str]]:
    """(score, explanation) for t1..t{count}, from the judge's text. Raises `MalformedJudgement`."""
    data = json_object(text, MalformedJudgement)
    entries = data.get("scores") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise MalformedJudgement("the judge's answer has no `scores` list")
    if len(entries) != count:
        raise MalformedJudgement(f"expected {count} scores, got {len(entries)}")
    found: dict[int, tuple[float, str]] = {}
    for entry in entries:
        if not isinstance(entry, dict):
            raise MalformedJudgement(f"a score entry is not an object: {entry!r}")
        match = re.fullmatch(r"\s*t?(\d+)\s*", str(entry.get("trajectory_id", "")))
        index = int(match.group(1)) if match else 0
        if not 1 <= index <= count or index in found:
            raise MalformedJudgement(f"unknown or repeated trajectory_id {entry.get('trajectory_id')!r}")
        score = entry.get("score")
        if isinstance(score, str):
            try:
                score = float(score)
            except ValueError:
                score = None
        if isinstance(score, bool) or not isinstance(score, int | float) or not 0.0 <= score <= 1.0:
            raise MalformedJudgement(f"score of t{index} is not a number in [0, 1]: {entry.get('score')!r}")
        found[index] = (float(score), str(entry.get("explanation") or "").strip())
    return [found[i] for i in range(1, count + 1)]


# ----------------------------------------------------------------------------- calling
async def import_litellm() -> ModuleType:
    """litellm, imported in a worker thread: its import is seconds of CPU (10 s on a 2-core machine), and the
    scheduler judges inside the serving process, whose calls in flight would all wait for it on the event loop."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # never fetch the price list at run time
    return await asyncio.to_thread(importlib.import_module, "litellm")


def litellm_model(settings: JudgeSettings, providers: Sequence[str]) -> str:
    """A plain model name with an API base is an OpenAI-compatible server: litellm's `openai/` provider."""
    provider = settings.model.split("/", 1)[0]
    if settings.api_base and (provider == settings.model or provider not in providers):
        return f"openai/{settings.model}"
    return settings.model


def takes_seed(litellm: ModuleType, settings: JudgeSettings) -> bool:
    """Whether litellm sends `seed` to this model's provider (OpenAI-compatible servers, vLLM and OpenAI do;
    Anthropic does not, and litellm would refuse the whole call if it were passed)."""
    try:
        model, provider, _, _ = litellm.get_llm_provider(
            litellm_model(settings, litellm.provider_list), api_base=settings.api_base or None
        )
        return "seed" in (
            litellm.get_supported_openai_params(model=model, custom_llm_provider=provider) or []
        )
    except Exception:  # a provider litellm cannot name fails the call itself, with its own message
        return False


def offset_seed(seed: int | None, offset: int) -> int | None:
    """`seed` + `offset`, wrapped into [0, 2^63); None stays None (unseeded)."""
    return None if seed is None else (seed + offset) % SEED_SPACE


class PolicyJudge:
    """A judge at the URL a policy names: an OpenAI-compatible server (what `api_base` means), reached through
    Kaizen's pinned client, since litellm's own would look the name up again and follow redirects. Its owner (a
    `Scorer`) keeps one for its lifetime, so every call shares the client's connections (each request is still
    checked where it connects), and closes it with `aclose`. A leading `openai/` or `hosted_vllm/` names the
    provider, not the model."""

    def __init__(self, settings: JudgeSettings) -> None:
        self.settings = settings
        name = settings.model
        for provider in ("openai/", "hosted_vllm/"):
            name = name.removeprefix(provider)
        self.model = f"openai/{name}"  # litellm's model string
        self._client: Any = None

    def client(self) -> Any:
        """The OpenAI client, made on the first call: openai comes with litellm, imported by then."""
        if self._client is None:
            from openai import AsyncOpenAI

            settings = self.settings
            self._client = AsyncOpenAI(
                base_url=settings.api_base,
                api_key=settings.api_key or "unused",
                max_retries=0,
                timeout=settings.timeout_s,
                # openai accepts an httpx client as well as its own httpx2 one; its annotation names only
                # the latter.
                http_client=policy_client(  # type: ignore[arg-type]
                    private_networks=settings.private_networks, timeout=settings.timeout_s
                ),
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()


async def litellm_complete(
    messages: list[dict[str, Any]],
    fmt: dict[str, Any],
    settings: JudgeSettings,
    *,
    policy_judge: PolicyJudge | None = None,
) -> Completion:
    """One completion through litellm. A judge at a URL the policy names (`policy_api_base`) is called through
    `policy_judge`, its owner's, and never through litellm's own client."""
    litellm = await import_litellm()
    seed = settings.seed if settings.seed is not None and takes_seed(litellm, settings) else None
    model = litellm_model(settings, litellm.provider_list)
    client: Any = None
    if settings.policy_api_base and settings.api_base:
        if policy_judge is None:
            raise ValueError("a judge at a URL the policy names is called through its owner's PolicyJudge")
        model, client = policy_judge.model, policy_judge.client()
    started = time.perf_counter()
    response = await litellm.acompletion(
        model=model,
        messages=messages,
        api_base=settings.api_base or None,
        api_key=settings.api_key or ("unused" if settings.api_base else None),
        temperature=settings.temperature,
        timeout=settings.timeout_s,
        response_format=fmt,
        max_tokens=settings.max_tokens,
        seed=seed,
        extra_headers=NO_LOG_HEADERS,
        num_retries=0,  # retries (with the malformed-answer ones) are ours
        **({} if client is None else {"client": client}),
    )
    text = response.choices[0].message.content or ""
    cost = (getattr(response, "_hidden_params", None) or {}).get("response_cost")
    latency_ms = (time.perf_counter() - started) * 1000
    return Completion(text, float(cost) if cost is not None else None, latency_ms)


async def judge_group(
    conversations: Sequence[Sequence[Mapping[str, Any]]],
    trajectory_ids: Sequence[str],
    rubric: str,
    settings: JudgeSettings,
    complete: Complete = litellm_complete,
) -> JudgeOutcome:
    """Score a group relative to itself. Never raises for judge failures: the outcome carries the error."""
    if len(conversations) != len(trajectory_ids) or not conversations:
        raise ValueError("one id per trajectory, and at least one trajectory")
    messages: list[dict[str, Any]] = list(build_prompt(conversations, rubric))
    answer = await ask_json(
        messages,
        response_format(len(conversations)),
        settings,
        lambda text: parse_scores(text, len(conversations)),
        complete,
        what="judge",
    )
    judgements = None
    if answer.value is not None:
        judgements = [
            Judgement(trajectory_id, score, explanation)
            for trajectory_id, (score, explanation) in zip(trajectory_ids, answer.value, strict=True)
        ]
    return JudgeOutcome(
        settings.model, answer.attempts, answer.latency_ms, answer.cost_usd, judgements, answer.error
    )


@dataclass(frozen=True)
class Answer(Generic[T]):
    """A parsed answer (None when every attempt failed) and what asking for it took."""

    value: T | None
    attempts: int
    latency_ms: float  # of the last attempt
    cost_usd: float | None  # summed over attempts when the provider's price is known
    error: str | None = None


async def ask_json(
    messages: list[dict[str, Any]],
    fmt: dict[str, Any],
    settings: JudgeSettings,
    parse: Callable[[str], T],
    complete: Complete = litellm_complete,
    *,
    what: str = "model",
) -> Answer[T]:
    """Ask for a structured answer; failed calls and answers `parse` refuses are retried with backoff.

    Never raises for the model's failures: after `settings.max_retries` retries the answer carries the error.
    A seeded retry is sent with the next seed: a seeded engine would repeat the answer it refused.
    """
    cost: float | None = None
    error = "not attempted"
    latency_ms = 0.0
    attempts = 0
    for attempt in range(settings.max_retries + 1):
        if attempt:
            await asyncio.sleep(settings.backoff_s * 2 ** (attempt - 1))
        attempts += 1
        started = time.perf_counter()
        try:
            answer = await complete(
                messages, fmt, replace(settings, seed=offset_seed(settings.seed, attempt))
            )
            latency_ms = answer.latency_ms
            if answer.cost_usd is not None:
                cost = (cost or 0.0) + answer.cost_usd
            value = parse(answer.text)
        except Exception as exc:  # any provider error or bad answer is retried, then reported
            latency_ms = (time.perf_counter() - started) * 1000
            error = f"{type(exc).__name__}: {exc}"[:2000]
            log.warning("%s attempt %d/%d failed: %s", what, attempt + 1, settings.max_retries + 1, error)
            continue
        return Answer(value, attempts, latency_ms, cost)
    return Answer(None, attempts, latency_ms, cost, error)
