"""The simulated app: asks the task's questions through the gateway with the `openai` SDK and sends every reply's
reward back through the signed feedback webhook, exactly as a production app with a thumbs-up button would. For an
agent task (`AgentApp`) an episode is an agent loop: the app offers its tool, runs the calls the model asks for
itself, sends the results back, and rewards the episode's final answer once."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx
from openai import AsyncOpenAI

from gateway.demo.agent_tasks import TOOL_NAME, AgentTask, Locker, open_locker, right_call
from gateway.demo.agent_tasks import reward as locker_reward
from gateway.demo.tasks import Question, reward
from gateway.signing import HEADER, sign

logger = logging.getLogger(__name__)

#: Tries of one feedback webhook before its reward is given up (and logged).
FEEDBACK_ATTEMPTS = 3


@dataclass(frozen=True)
class CallResult:
    question: str
    reply: str
    reward: float
    version: int | None  # the policy version that served the call (from `x-kaizen-model`)
    finished_s: float  # seconds since the app started
    error: str | None = None
    #: An agent episode's path to its answer: it called the tool, called it rightly (the question's own
    #: argument), answered from the right result. None for one-answer tasks.
    called_tool: bool | None = None
    right_call: bool | None = None
    answered_from_result: bool | None = None
    #: The gateway's id of the answered call (`x-request-id` of the reply), and whether the gateway accepted
    #: its reward: what a fault benchmark counts against the database.
    call_id: str | None = None
    rewarded: bool = False


def served_version(header: str | None) -> int | None:
    """`demo@3` -> 3; None for the base model or a missing header."""
    if not header or "@" not in header:
        return None
    suffix = header.rsplit("@", 1)[1]
    return int(suffix) if suffix.isdigit() else None


class SimulatedApp:
    """Sends calls at a steady rate; questions come round-robin from a shuffled pool, so a cycle of as many
    calls as there are questions asks each one exactly once."""

    #: Tries of one feedback webhook (a fault benchmark raises it to outlast a database restart).
    feedback_attempts = FEEDBACK_ATTEMPTS

    def __init__(
        self,
        base_url: str,
        api_key: str,
        feedback_secret: str,
        questions: list[Question],
        *,
        model: str,
        rate: float,
        concurrency: int,
        max_tokens: int,
        seed: int,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.client = AsyncOpenAI(base_url=self.base_url, api_key=api_key, max_retries=5, timeout=300)
        self.http = httpx.AsyncClient(timeout=30, headers={"Authorization": f"Bearer {api_key}"})
        self.feedback_secret = feedback_secret
        self.questions = questions
        self.model = model
        self.rate = rate
        self.concurrency = concurrency
        self.max_tokens = max_tokens
        self.random = random.Random(seed)
        self.pool: list[Question] = []
        self.started = time.monotonic()

    def _next_question(self) -> Question:
        if not self.pool:
            self.pool = list(self.questions)
            self.random.shuffle(self.pool)
        return self.pool.pop()

    async def cycle(self, calls: int) -> list[CallResult]:
        """Send `calls` calls at `rate` per second (at most `concurrency` in flight) with their feedback; return
        when all are answered and rewarded. A steady rate, like real users, leaves the CPU to training too."""
        slots = asyncio.Semaphore(self.concurrency)

        async def one(question: Question) -> CallResult:
            async with slots:
                return await self._call(question)

        tasks: list[asyncio.Task[CallResult]] = []
        try:
            for _ in range(calls):
                tasks.append(asyncio.create_task(one(self._next_question())))
                await asyncio.sleep(1 / self.rate)
            return list(await asyncio.gather(*tasks))
        except BaseException:
            # A cycle cut short (the demo was stopped) leaves no call running behind it.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _call(self, question: Question) -> CallResult:
        try:
            raw = await self.client.chat.completions.with_raw_response.create(
                model=self.model,
                messages=[{"role": "user", "content": question.prompt}],
                max_tokens=self.max_tokens,
                temperature=1.0,
                metadata={"group_key": question.key},
            )
        except Exception as exc:  # counted in the cycle's errors; the demo goes on like an app would
            logger.warning("call failed: %s", exc)
            return CallResult(question.key, "", 0.0, None, self._now(), error=str(exc))
        completion = raw.parse()
        reply = completion.choices[0].message.content or ""
        value = reward(reply, question)
        call_id = raw.headers["x-request-id"]
        rewarded = await self._feedback(call_id, value)
        return CallResult(
            question.key,
            reply,
            value,
            served_version(raw.headers.get("x-kaizen-model")),
            self._now(),
            call_id=call_id,
            rewarded=rewarded,
        )

    async def _feedback(self, request_id: str, value: float, target: str = "request_id") -> bool:
        """Send the reward as a webhook would: a connection lost on the way (a keep-alive connection the
        gateway closed as it was reused) or a 5xx is retried, freshly signed; the idempotency key stores it once.
        True when the gateway accepted it."""
        item = {
            target: request_id,
            "value": value,
            "name": "user",
            "idempotency_key": f"demo:{request_id}",
        }
        body = json.dumps(item).encode()
        for attempt in range(1, self.feedback_attempts + 1):
            headers = {"Content-Type": "application/json", HEADER: sign(self.feedback_secret, body)}
            try:
                response = await self.http.post(f"{self.base_url}/feedback", content=body, headers=headers)
            except httpx.TransportError as exc:
                logger.warning("feedback attempt %d of %d failed: %r", attempt, self.feedback_attempts, exc)
                await asyncio.sleep(attempt)  # a new second: a new signature, not a replay
                continue
            if response.status_code >= 500 and attempt < self.feedback_attempts:
                logger.warning(
                    "feedback attempt %d of %d: %d", attempt, self.feedback_attempts, response.status_code
                )
                await asyncio.sleep(attempt)
                continue
            if response.status_code >= 400:
                logger.warning("feedback refused (%d): %s", response.status_code, response.text[:200])
            return response.status_code < 300
        return False

    def _now(self) -> float:
        return time.monotonic() - self.started

    async def close(self) -> None:
        await self.client.close()
        await self.http.aclose()


class AgentApp(SimulatedApp):
    """An agent app: each question is an episode of up to `task.max_turns` calls with the task's tool offered,
    the first forced to call a tool as the task says; the app runs the calls itself and rewards the episode's
    final answer once (by its episode id)."""

    def __init__(self, *args: Any, task: AgentTask, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.task = task

    async def _call(self, question: Any) -> CallResult:
        locker: Locker = question
        episode = uuid.uuid4().hex
        messages: list[dict[str, Any]] = [{"role": "user", "content": locker.prompt}]
        called = right = False
        version = None
        try:
            for turn in range(self.task.max_turns):
                request: dict[str, Any] = {
                    "model": self.model,
                    "messages": messages,
                    "tools": [self.task.tool],
                    "tool_choice": self.task.first_tool_choice if turn == 0 else "auto",
                    "max_tokens": self.max_tokens,
                    "temperature": 1.0,
                    "metadata": {"group_key": locker.key},
                    "extra_headers": {"X-Episode-Id": episode},
                }
                raw = await self.client.chat.completions.with_raw_response.create(**request)
                version = served_version(raw.headers.get("x-kaizen-model"))
                message = raw.parse().choices[0].message
                calls = message.tool_calls or []
                if not calls:
                    break
                messages.append(message.model_dump(exclude_none=True))
                for call in calls:
                    arguments = call.function.arguments  # type: ignore[union-attr]
                    called = True
                    right = right or right_call(arguments, locker)
                    result = (
                        open_locker(json.loads(arguments).get("number", -1))
                        if call.function.name == TOOL_NAME and _object(arguments)  # type: ignore[union-attr]
                        else json.dumps({"error": "unknown tool or arguments"})
                    )
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        except Exception as exc:  # counted in the cycle's errors; the demo goes on like an app would
            logger.warning("episode failed: %s", exc)
            return CallResult(locker.key, "", 0.0, version, self._now(), error=str(exc))
        answer = message.content if not calls else None
        value = locker_reward(answer, locker)
        rewarded = await self._feedback(episode, value, target="episode_id")
        return CallResult(
            locker.key,
            answer or "",
            value,
            version,
            self._now(),
            called_tool=called,
            right_call=right,
            answered_from_result=right and value == 1.0,
            call_id=raw.headers["x-request-id"],
            rewarded=rewarded,
        )


def _object(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False
