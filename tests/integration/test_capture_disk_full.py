"""A full disk under a real `kaizen serve` (scripted upstream behind it, the official SDK in front): the capture
log's writes fail while calls come in, then space comes back.

By default every call is still answered; the loss of durability is reported (`/readyz`, metrics, an error line
in the log), the calls held only in memory still reach the database, and the gateway goes back to the log by
itself once space returns. With `KAIZEN_CAPTURE_REQUIRE_DURABLE=true` a call that cannot be logged is refused
with an OpenAI-shaped 503 instead, before it reaches the engine while the disk stays full.

The disk is full for the gateway process alone (`tests.support.disk_limits`: the kernel refuses its writes that
would grow a file, which needs no privileges, unlike mounting a small file system)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from gateway.commands.serve_process import GatewayProcess
from tests.integration.test_capture_faults import one_call, stored_calls
from tests.support.child_gateway import sdk, start, upstream_gateway
from tests.support.disk_limits import LogPipe, allow_file_growth, capture_writer_pid, refuse_file_growth
from tests.support.polling import wait_until_async
from tests.support.scripted_upstream import ScriptedUpstream

DOWN_LINE = "the capture log cannot be written"
BACK_LINE = "the capture log can be written again"


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'kaizen.db'}"


def piped_gateway(
    tmp_path: Path, upstream: ScriptedUpstream, database_url: str, env: dict[str, str] | None = None
) -> tuple[GatewayProcess, LogPipe]:
    gateway = upstream_gateway(
        tmp_path / "data", database_url, upstream.url, {"KAIZEN_LOG_LEVEL": "info", **(env or {})}
    )
    return gateway, LogPipe(gateway, tmp_path / "gateway.log")


@pytest.fixture
def gateway(
    tmp_path: Path, upstream: ScriptedUpstream, sqlite_url: str
) -> Iterator[tuple[GatewayProcess, LogPipe]]:
    child, pipe = piped_gateway(tmp_path, upstream, sqlite_url)
    yield child, pipe
    child.stop()


@pytest.fixture
def strict_gateway(
    tmp_path: Path, upstream: ScriptedUpstream, sqlite_url: str
) -> Iterator[tuple[GatewayProcess, LogPipe]]:
    child, pipe = piped_gateway(tmp_path, upstream, sqlite_url, {"KAIZEN_CAPTURE_REQUIRE_DURABLE": "true"})
    yield child, pipe
    child.stop()


async def readiness(gateway: GatewayProcess) -> tuple[int, dict[str, Any]]:
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.get(gateway.url + "/readyz")
    return response.status_code, response.json()


async def capture_metrics(gateway: GatewayProcess) -> dict[str, float]:
    """The capture samples of a scrape, and refusals by code (`rejected:<code>`)."""
    admin = {"authorization": f"Bearer {gateway.admin_key}"}  # the gateway has keys: /metrics wants one
    async with httpx.AsyncClient(timeout=10) as http:
        scraped = await http.get(gateway.url + "/metrics", headers=admin)
    assert scraped.status_code == 200, scraped.text
    text = scraped.text
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("kaizen_capture_"):
                found[sample.name.removeprefix("kaizen_capture_")] = sample.value
            elif sample.name == "kaizen_requests_rejected_total":
                found["rejected:" + sample.labels["code"]] = sample.value
    return found


async def answer_all(client: AsyncOpenAI, texts: list[str]) -> list[str]:
    """Each text as one call (every other one streamed), four at a time; the ids of their complete 200s."""
    limit = asyncio.Semaphore(4)

    async def call(index: int, text: str) -> str:
        async with limit:
            return await one_call(client, text, stream=index % 2 == 1)

    return await asyncio.gather(*(call(i, text) for i, text in enumerate(texts)))


async def wait_stored(database_url: str, ids: set[str]) -> list[dict[str, Any]]:
    async def done() -> bool:
        return ids <= {row["id"] for row in await stored_calls(database_url)}

    await wait_until_async(done, f"{len(ids)} answered calls stored", timeout_s=60)
    return await stored_calls(database_url)


def test_a_full_disk_keeps_answering_reports_it_and_recovers_by_itself(
    gateway: tuple[GatewayProcess, LogPipe], sqlite_url: str
) -> None:
    child, log = gateway

    async def scenario() -> None:
        await start(child)
        assert child.process is not None
        pid = child.process.pid
        client = sdk(child)
        before = await answer_all(client, [f"before {n}" for n in range(6)])
        assert (await readiness(child))[0] == 200

        refuse_file_growth(pid)
        writer = capture_writer_pid(pid)
        os.kill(writer, signal.SIGSTOP)  # the calls held in memory stay there until it goes on
        try:
            during = await answer_all(client, [f"during {n}" for n in range(10)])
            status, body = await readiness(child)
            assert (status, body["status"], body["capture"]) == (200, "ready", "memory"), body
            metrics = await capture_metrics(child)
            assert metrics["durable"] == 0 and metrics["memory_calls"] == 10, metrics
            assert metrics["memory_bytes"] > 0 and metrics["log_failures_total"] == 10, metrics
            assert metrics["dropped_total"] == 0, metrics

            async def error_logged() -> bool:
                return log.count(DOWN_LINE) == 1

            await wait_until_async(error_logged, "an error line saying the log cannot be written")
        finally:
            os.kill(writer, signal.SIGCONT)

        async def memory_stored() -> bool:
            return (await capture_metrics(child))["memory_calls"] == 0

        await wait_until_async(memory_stored, "the calls held in memory stored")

        allow_file_growth(pid)

        async def back_to_the_log() -> bool:
            return (await readiness(child))[1]["capture"] == "log"

        await wait_until_async(back_to_the_log, "/readyz to report the capture log again")
        assert log.count(BACK_LINE) == 1
        after = await answer_all(client, [f"after {n}" for n in range(6)])
        await client.close()
        metrics = await capture_metrics(child)
        assert metrics["durable"] == 1 and metrics["log_failures_total"] == 10, metrics

        rows = await wait_stored(sqlite_url, {*before, *during, *after})
        assert len(rows) == 22, Counter(row["text"] for row in rows).most_common(3)
        assert Counter(row["id"] for row in rows).most_common(1)[0][1] == 1
        assert all(row["status"] == "ok" for row in rows)

    asyncio.run(scenario())


def test_strict_mode_refuses_calls_it_cannot_log_and_recovers_by_itself(
    strict_gateway: tuple[GatewayProcess, LogPipe], upstream: ScriptedUpstream, sqlite_url: str
) -> None:
    child, log = strict_gateway

    async def scenario() -> None:
        await start(child)
        assert child.process is not None
        pid = child.process.pid
        client = sdk(child)
        answered = await answer_all(client, [f"before {n}" for n in range(4)])

        # The first call after the disk fills reaches the engine: its record is what fails. A stream has sent its
        # chunks by then, so it ends with an error event instead of `[DONE]`.
        refuse_file_growth(pid)
        with pytest.raises(openai.APIError) as ended:
            await one_call(client, "refused at its end", stream=True)
        assert ended.value.code == "capture_unavailable"
        reached = len(upstream.requests)

        # Later calls are refused before the engine, streamed or not, with an OpenAI-shaped 503.
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as refused:
                await one_call(client, f"refused up front {stream}", stream=stream)
            error = refused.value.response.json()["error"]
            assert refused.value.status_code == 503 and error["code"] == "capture_unavailable", error
            assert error["type"] == "api_error" and "capture log" in error["message"]
            assert refused.value.response.headers["retry-after"] == "1"
        assert len(upstream.requests) == reached
        # A call the client asked not to record has nothing to refuse.
        await one_call(client, "not recorded", stream=False, headers={"x-kaizen-no-log": "true"})
        status, body = await readiness(child)
        assert (status, body["status"], body["capture"]) == (503, "not_ready", "refusing"), body
        metrics = await capture_metrics(child)
        assert metrics["durable"] == 0 and metrics["refused_total"] == 1, metrics
        assert metrics["rejected:capture_unavailable"] == 2 and metrics["memory_calls"] == 0, metrics
        assert log.count(DOWN_LINE) == 1

        allow_file_growth(pid)

        async def ready_again() -> bool:
            status, body = await readiness(child)
            return (status, body["capture"]) == (200, "log")

        await wait_until_async(ready_again, "/readyz to answer 200 again")
        answered += await answer_all(client, [f"after {n}" for n in range(4)])

        # A non-streamed call whose record fails is refused with the 503 too, after the engine answered it.
        refuse_file_growth(pid)
        with pytest.raises(openai.APIStatusError) as late:
            await one_call(client, "refused after the engine", stream=False)
        assert late.value.status_code == 503 and late.value.code == "capture_unavailable"
        allow_file_growth(pid)
        await wait_until_async(ready_again, "/readyz to answer 200 again")
        await client.close()

        rows = await wait_stored(sqlite_url, set(answered))
        assert sorted(row["id"] for row in rows) == sorted(answered)  # nothing refused is stored

    asyncio.run(scenario())
