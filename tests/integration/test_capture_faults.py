"""Capture you can trust: every call a client got a complete 200 for is in `calls` exactly once, whatever
happens to the gateway process. The gateway is a real `kaizen serve` child (scripted upstream behind it), killed
with SIGKILL or stopped with SIGTERM under load, on SQLite and PostgreSQL; the client is the official SDK.
Rewards sent with idempotency keys around a crash are stored exactly once."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from gateway.commands.serve_process import GatewayProcess
from gateway.signing import sign
from tests.support.child_gateway import kill, sdk, start, terminate, upstream_gateway
from tests.support.polling import poll
from tests.support.scripted_upstream import ScriptedUpstream
from tests.support.sql import fetch_rows

CALLS = 400
CONCURRENCY = 16
FEEDBACK_EVERY = 3  # every third answered call gets a reward
SECRET = "fault-suite-secret"
REPLAY_TIMEOUT_S = 20.0


class IncompleteStream(Exception):
    """The stream ended without a chunk carrying `finish_reason`."""


# What a client sees when the gateway dies or refuses under it: the SDK's errors, raw transport errors
# raised while a stream is read, and a stream that ended without its final chunk.
FAULTS: tuple[type[Exception], ...] = (openai.APIError, httpx.HTTPError, IncompleteStream)


@pytest.fixture
def gateway(tmp_path: Path, upstream: ScriptedUpstream, database_url: str) -> Iterator[GatewayProcess]:
    child = upstream_gateway(
        tmp_path / "data", database_url, upstream.url, {"KAIZEN_FEEDBACK_SECRET": SECRET}
    )
    yield child
    child.stop()


async def one_call(
    client: AsyncOpenAI, text: str, *, stream: bool, headers: dict[str, str] | None = None
) -> str:
    """One chat call; returns the `x-request-id` of a complete 200 response, raises on anything else."""
    messages: Any = [{"role": "user", "content": text}]
    if not stream:
        raw = await client.chat.completions.with_raw_response.create(
            model="scripted-1", messages=messages, extra_headers=headers
        )
        request_id = raw.headers["x-request-id"]
        completion = raw.parse()
        assert completion.id == f"chatcmpl-{request_id}"
        assert completion.choices[0].finish_reason == "stop"
        return request_id
    raw_stream = await client.chat.completions.with_raw_response.create(
        model="scripted-1", messages=messages, stream=True, extra_headers=headers
    )
    request_id = raw_stream.headers["x-request-id"]
    finished = False
    async for chunk in raw_stream.parse():
        assert chunk.id == f"chatcmpl-{request_id}"
        finished |= any(choice.finish_reason == "stop" for choice in chunk.choices)
    if not finished:
        raise IncompleteStream(request_id)
    return request_id


def message_text(request: Any) -> str:
    """The user text a stored call was made with (JSON columns come back as text from SQLite)."""
    body = json.loads(request) if isinstance(request, str) else request
    return str(body["messages"][-1]["content"])


async def stored_calls(database_url: str) -> list[dict[str, Any]]:
    rows = await fetch_rows(database_url, "SELECT * FROM calls")
    for row in rows:
        row["text"] = message_text(row["request"])
    return rows


@dataclass
class Load:
    """Shared state of one load run: which jobs were answered (and with which id), which failed."""

    gateway: GatewayProcess
    client: AsyncOpenAI
    jobs: asyncio.Queue[int] = field(default_factory=asyncio.Queue)
    up: asyncio.Event = field(default_factory=asyncio.Event)
    kill_now: asyncio.Event = field(default_factory=asyncio.Event)
    answered: dict[int, str] = field(default_factory=dict)  # job -> x-request-id of its complete 200
    failed: dict[int, str] = field(default_factory=dict)  # job -> the client's error
    feedback_keys: set[str] = field(default_factory=set)  # idempotency keys the gateway accepted


def job_text(job: int) -> str:
    return f"call {job}"


async def send_feedback(load: Load, http: httpx.AsyncClient, request_id: str, key: str) -> None:
    """A reward for one call, retried like a webhook sender would until the gateway accepts it."""
    attempt = 0
    while True:
        attempt += 1
        await load.up.wait()
        # The attempt number is part of the signed body: a retry is a new delivery, not a replayed signature.
        body = json.dumps(
            {"request_id": request_id, "value": 1.0, "idempotency_key": key, "metadata": {"attempt": attempt}}
        ).encode()
        try:
            response = await http.post(
                load.gateway.url + "/v1/feedback",
                content=body,
                headers={"x-kaizen-signature": sign(SECRET, body), "content-type": "application/json"},
            )
        except httpx.HTTPError:
            continue
        if response.status_code == 200:
            load.feedback_keys.add(key)
            return
        assert response.status_code >= 500, response.text  # a 4xx would be a bug, not a fault to retry
        assert attempt < 100, f"feedback {key} still refused after {attempt} attempts: {response.text}"


async def worker(load: Load, http: httpx.AsyncClient) -> None:
    while not load.jobs.empty():
        job = load.jobs.get_nowait()
        await load.up.wait()
        try:
            request_id = await one_call(load.client, job_text(job), stream=job % 2 == 1)
        except FAULTS as exc:
            load.failed[job] = repr(exc)
            continue
        load.answered[job] = request_id
        if len(load.answered) >= CALLS // 2:
            load.kill_now.set()
        if job % FEEDBACK_EVERY == 0:
            await send_feedback(load, http, request_id, f"reward-{job}")


async def crash_midway(load: Load) -> None:
    """SIGKILL once half the calls were answered (progress, not time), then restart on the same data."""
    await load.kill_now.wait()
    load.up.clear()
    await kill(load.gateway)
    await start(load.gateway)
    stale, load.client = load.client, sdk(load.gateway)  # the old pool's connections died with the process
    await stale.close()
    load.up.set()


@pytest.mark.slow
def test_sigkill_under_load_loses_and_duplicates_nothing(gateway: GatewayProcess, database_url: str) -> None:
    async def scenario() -> tuple[Load, bool, list[dict[str, Any]], list[dict[str, Any]]]:
        await start(gateway)
        load = Load(gateway, sdk(gateway))
        load.up.set()
        for job in range(CALLS):
            load.jobs.put_nowait(job)
        async with httpx.AsyncClient(timeout=30) as http:
            crash = asyncio.create_task(crash_midway(load))
            await asyncio.gather(*(worker(load, http) for _ in range(CONCURRENCY)))
            assert crash.done(), "the load finished before the gateway was killed"
            await crash
        await load.client.close()
        answered_ids = set(load.answered.values())

        async def all_stored() -> bool:
            return answered_ids <= {row["id"] for row in await stored_calls(database_url)}

        replayed = await poll(all_stored, REPLAY_TIMEOUT_S)
        rewards = await fetch_rows(database_url, "SELECT idempotency_key FROM rewards")
        return load, replayed, await stored_calls(database_url), rewards

    load, replayed, rows, rewards = asyncio.run(scenario())

    assert len(load.answered) + len(load.failed) == CALLS
    # Only calls in flight at the kill may fail (a fresh client is used after the restart).
    assert len(load.failed) <= CONCURRENCY, load.failed
    by_id = {row["id"]: row for row in rows}
    lost = {job: rid for job, rid in load.answered.items() if rid not in by_id}
    assert not lost, (
        f"{len(lost)} of {len(load.answered)} calls answered with 200 are not in `calls` "
        f"(writer caught up: {replayed}); e.g. {sorted(lost.items())[:5]}"
    )
    for job, request_id in load.answered.items():
        row = by_id[request_id]
        assert (row["text"], row["status"]) == (job_text(job), "ok"), row
    repeated = {text: n for text, n in Counter(row["text"] for row in rows).items() if n > 1}
    assert not repeated, f"calls stored more than once: {repeated}"
    assert {row["text"] for row in rows} <= {job_text(job) for job in range(CALLS)}

    sent = {f"reward-{job}" for job in load.answered if job % FEEDBACK_EVERY == 0}
    assert load.feedback_keys == sent
    key_counts = Counter(row["idempotency_key"] for row in rewards)
    assert set(key_counts) == sent, set(key_counts) ^ sent
    assert all(n == 1 for n in key_counts.values()), {k: n for k, n in key_counts.items() if n > 1}


@dataclass
class Shutdown:
    """Outcomes of calls sent around a SIGTERM."""

    answered: list[str] = field(default_factory=list)  # x-request-ids of complete 200s
    refused: list[tuple[int, bool, str]] = field(default_factory=list)  # (status, OpenAI-shaped, body)
    connection_errors: int = 0
    in_flight: int = 0
    in_flight_at_term: int = -1
    after_term: int = 0  # calls sent after the signal


def is_openai_error(response: httpx.Response) -> bool:
    try:
        body = response.json()
    except ValueError:
        return False
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error)


@pytest.mark.slow
def test_sigterm_with_calls_in_flight_stores_every_answered_call(
    gateway: GatewayProcess, database_url: str
) -> None:
    slow_ms = 300

    async def scenario() -> tuple[Shutdown, int, list[dict[str, Any]]]:
        await start(gateway)
        client = sdk(gateway)  # one pool: calls after the signal reuse kept-alive connections
        state = Shutdown()
        terminating = asyncio.Event()
        term_now = asyncio.Event()

        async def sender(index: int) -> None:
            refusals = 0
            for k in range(1000):
                if terminating.is_set():
                    state.after_term += 1
                state.in_flight += 1
                try:
                    state.answered.append(
                        await one_call(client, f"term {index}-{k} #slow {slow_ms}", stream=k % 4 == 3)
                    )
                except openai.APIStatusError as exc:
                    state.refused.append((exc.status_code, is_openai_error(exc.response), exc.response.text))
                    refusals += 1
                except (openai.APIConnectionError, httpx.HTTPError, IncompleteStream):
                    state.connection_errors += 1
                    refusals += 1
                finally:
                    state.in_flight -= 1
                if len(state.answered) >= 2 * CONCURRENCY:
                    term_now.set()
                if refusals >= 3 or (
                    terminating.is_set() and gateway.process and gateway.process.poll() is not None
                ):
                    return

        senders = [asyncio.create_task(sender(i)) for i in range(CONCURRENCY)]
        await term_now.wait()
        state.in_flight_at_term = state.in_flight
        terminating.set()
        code = await terminate(gateway)
        await asyncio.gather(*senders)
        await client.close()
        return state, code, await stored_calls(database_url)

    state, code, rows = asyncio.run(scenario())

    assert code in (0, -15)  # uvicorn re-raises SIGTERM after its graceful shutdown
    assert state.in_flight_at_term > 0 and state.after_term > 0
    # Calls refused during shutdown: a connection error, or a 503 with an OpenAI-shaped body, nothing else.
    assert all(status == 503 and shaped for status, shaped, _ in state.refused), state.refused
    stored = {row["id"]: row for row in rows}
    lost = [rid for rid in state.answered if rid not in stored]
    assert not lost, (
        f"{len(lost)} of {len(state.answered)} calls answered with 200 are not in `calls`: {lost[:5]}"
    )
    assert all(stored[rid]["status"] == "ok" for rid in state.answered)
    repeated = {text: n for text, n in Counter(row["text"] for row in rows).items() if n > 1}
    assert not repeated, f"calls stored more than once: {repeated}"


def test_repeated_client_request_id_stores_both_calls(gateway: GatewayProcess, database_url: str) -> None:
    """A client reusing its own `x-request-id` (a retry, or a bug) makes two calls: both are stored, each under
    its own server id, with the client's id kept beside it."""

    async def scenario() -> tuple[list[str], list[dict[str, Any]]]:
        await start(gateway)
        headers = {"x-request-id": "client-retry-7"}
        async with sdk(gateway) as client:
            ids = [
                await one_call(client, "first use of the id", stream=False, headers=headers),
                await one_call(client, "second use of the id", stream=True, headers=headers),
            ]

        async def both_stored() -> bool:
            return len(await stored_calls(database_url)) >= 2

        await poll(both_stored, REPLAY_TIMEOUT_S)
        return ids, await stored_calls(database_url)

    ids, rows = asyncio.run(scenario())
    rows.sort(key=lambda row: str(row["text"]))
    assert [row["text"] for row in rows] == ["first use of the id", "second use of the id"]
    assert [row["id"] for row in rows] == ids and len(set(ids)) == 2
    assert all(row["status"] == "ok" for row in rows)
    assert [row["client_request_id"] for row in rows] == ["client-retry-7"] * 2
