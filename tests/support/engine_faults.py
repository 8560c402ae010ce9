"""Load through a gateway while one of its engine replicas is killed, counting what every client saw."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.support.polling import poll


@dataclass
class Outcomes:
    """What the clients saw: `counts` by kind, and the server ids of the complete answers and the broken streams."""

    counts: Counter[str] = field(default_factory=Counter)
    answered: list[str] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)


async def load_with_a_kill(
    gateway_url: str,
    body_of: Callable[[int], dict[str, Any]],
    calls: int,
    concurrency: int,
    kill: Callable[[], Awaitable[None]],
    timeout_s: float,
) -> Outcomes:
    """Send `calls` chat calls (`body_of(n)`) at `concurrency`, and `kill` once a quarter of them are done.

    A call counts as `complete` when it is a 200 that is whole (a stream ending with `[DONE]`), as `stream broken
    mid-way` when a stream's last event is an OpenAI-shaped error, and by its status otherwise."""
    outcomes = Outcomes()

    async def one(client: httpx.AsyncClient, n: int) -> None:
        body = body_of(n)
        async with client.stream("POST", gateway_url + "/v1/chat/completions", json=body) as response:
            text = (await response.aread()).decode()
        if response.status_code != 200:
            outcomes.counts[f"status {response.status_code}"] += 1
            return
        request_id = response.headers["x-request-id"]
        if not body.get("stream") or text.rstrip().endswith("data: [DONE]"):
            outcomes.counts["complete"] += 1
            outcomes.answered.append(request_id)
            return
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        assert "error" in events[-1], events[-1]
        outcomes.counts["stream broken mid-way"] += 1
        outcomes.broken.append(request_id)

    async def quarter_done() -> bool:
        return sum(outcomes.counts.values()) >= calls // 4

    async with httpx.AsyncClient(timeout=timeout_s) as client:
        queue = list(range(calls))

        async def worker() -> None:
            while queue:
                await one(client, queue.pop())

        workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
        assert await poll(quarter_done, timeout_s=timeout_s)
        await kill()
        await asyncio.gather(*workers)
    return outcomes
