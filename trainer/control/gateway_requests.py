"""The trainer's own chat completions against the gateway's OpenAI URL (resampling, the gate).

Kept free of torch and polars: the gate runs inside the serving process, which starts without them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx

#: A version written moments ago is unknown to the gateway until its next policy refresh (404), and an engine
#: restarting answers 503: both are retried for a while.
_RETRIED_STATUS = (404, 503)
#: How long the trainer's calls wait those out, and lost connections: long enough for vLLM to restart after a
#: crash (51 s on the reference machine, over two minutes while it trains beside other work), which would
#: otherwise fail the whole run.
ENGINE_RESTART_WAIT_S = 300.0

logger = logging.getLogger(__name__)


class EngineSamplingError(RuntimeError):
    """Replies could not be sampled through the serving engine (unreachable, refused, or without token ids)."""


def gateway_headers(api_key: str | None) -> dict[str, str]:
    """Headers of Kaizen's own calls to its gateway (resampling, the gate): never captured as traffic."""
    headers = {"X-Kaizen-No-Log": "true"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


async def post_completion(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    wait_s: float,
    unreachable_hint: str = "",
) -> dict[str, Any]:
    """POST a chat completion to the gateway; 404/503 answers and lost connections are retried for `wait_s`
    (a version written moments ago is unknown until the next policy refresh; an engine may be restarting; a
    gateway may be restarting or close a kept-alive connection as it is reused). Sampling changes nothing, so
    sending it again is safe; a request that timed out is not sent again."""
    deadline = time.monotonic() + wait_s
    waiting = False
    while True:
        try:
            response = await client.post(url, json=body, headers=headers)
        except httpx.TransportError as exc:
            if not isinstance(exc, httpx.TimeoutException) and time.monotonic() < deadline:
                waiting = _note_wait(waiting, url, repr(exc), deadline)
                await asyncio.sleep(0.5)
                continue
            raise EngineSamplingError(
                f"could not reach the gateway at {url} to sample {body.get('model')} ({exc!r}); "
                f"is `kaizen serve` running there (KAIZEN_GATE_URL)?{unreachable_hint}"
            ) from exc
        if response.status_code in _RETRIED_STATUS and time.monotonic() < deadline:
            waiting = _note_wait(waiting, url, f"{response.status_code} {response.text[:200]}", deadline)
            await asyncio.sleep(0.5)
            continue
        if response.status_code >= 400:
            raise EngineSamplingError(
                f"{body.get('model')} at {url} answered {response.status_code}: {response.text[:500]}"
            )
        answer = response.json()
        if not isinstance(answer, dict):
            raise EngineSamplingError(f"{url} returned a response that is not a JSON object")
        return answer


def _note_wait(waiting: bool, url: str, why: str, deadline: float) -> bool:
    """Log the first retry of a call (a restart under way is worth a line; every retry is not)."""
    if not waiting:
        logger.info("%s answered %s; retrying for up to %.0f s", url, why, deadline - time.monotonic())
    return True
