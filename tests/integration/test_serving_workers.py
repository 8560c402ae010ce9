"""`kaizen serve` with two serving workers on one port, as real processes: calls spread over both, `/metrics`
covers both, a worker SIGKILLed under load is replaced and loses nothing, and nothing outlives the parent,
whether it is stopped with SIGTERM or killed. With vLLM: one engine, started once, serves both workers, a
restart of that engine gives back the adapters the workers loaded, and a SIGKILLed parent takes the engine
with it."""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from gateway.commands.serve_process import GatewayProcess
from tests.conftest import MODELS_DIR
from tests.integration.test_capture_faults import FAULTS, job_text, one_call, stored_calls
from tests.support.child_gateway import kill, start, terminate, upstream_gateway
from tests.support.polling import poll
from tests.support.scripted_upstream import ScriptedUpstream

CALLS = 300
CONCURRENCY = 16
REPLAY_TIMEOUT_S = 30.0


@pytest.fixture
def gateway(tmp_path: Path, upstream: ScriptedUpstream, database_url: str) -> Iterator[GatewayProcess]:
    (tmp_path / "tmp").mkdir()  # the gateway's TMPDIR: where its workers' peer sockets live (`peer_dirs`)
    env = {"KAIZEN_WORKERS": "2", "TMPDIR": str(tmp_path / "tmp")}
    child = upstream_gateway(tmp_path / "data", database_url, upstream.url, env)
    yield child
    child.stop()


def sdk(gateway: GatewayProcess) -> AsyncOpenAI:
    """A client that opens a connection per call, so that calls land on whichever worker accepts first."""
    http = httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0), timeout=60)
    return AsyncOpenAI(base_url=gateway.url + "/v1", api_key=gateway.api_key, max_retries=0, http_client=http)


def workers(gateway: GatewayProcess) -> list[psutil.Process]:
    assert gateway.process is not None
    children = psutil.Process(gateway.process.pid).children()
    return [c for c in children if "gateway.workers" in " ".join(c.cmdline())]


def peer_dirs(tmp_path: Path) -> list[Path]:
    """The private directories of the workers' peer sockets that the `gateway` fixture's parent made."""
    return list((tmp_path / "tmp").glob("kaizen-workers-*"))


def family_tree(gateway: GatewayProcess) -> list[psutil.Process]:
    assert gateway.process is not None
    return psutil.Process(gateway.process.pid).children(recursive=True)


def requests_by_worker(gateway: GatewayProcess) -> Counter[str]:
    """`kaizen_requests_total` from one scrape, summed per `worker` label."""
    scraped = httpx.get(
        gateway.url + "/metrics", headers={"authorization": f"Bearer {gateway.admin_key}"}, timeout=10
    )
    assert scraped.status_code == 200, scraped.text
    text = scraped.text
    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kaizen_requests_total":
                counts[sample.labels["worker"]] += int(sample.value)
    return counts


async def gone(processes: list[psutil.Process], timeout_s: float = 30) -> bool:
    async def none_left() -> bool:
        return not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in processes)

    return await poll(none_left, timeout_s)


@dataclass
class Load:
    client: AsyncOpenAI
    jobs: asyncio.Queue[int] = field(default_factory=asyncio.Queue)
    kill_now: asyncio.Event = field(default_factory=asyncio.Event)
    answered: dict[int, str] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)


async def send(load: Load, kill_after: int) -> None:
    while not load.jobs.empty():
        job = load.jobs.get_nowait()
        try:
            load.answered[job] = await one_call(load.client, job_text(job), stream=job % 2 == 1)
        except FAULTS as exc:
            load.failed[job] = repr(exc)
        if len(load.answered) >= kill_after:
            load.kill_now.set()


@pytest.mark.slow
def test_two_workers_share_the_port_and_a_killed_worker_loses_nothing(
    gateway: GatewayProcess, database_url: str
) -> None:
    async def scenario() -> tuple[Load, list[psutil.Process], Counter[str]]:
        await start(gateway)
        first = workers(gateway)
        assert len(first) == 2
        load = Load(sdk(gateway))
        for job in range(CALLS):
            load.jobs.put_nowait(job)
        senders = [asyncio.create_task(send(load, CALLS // 2)) for _ in range(CONCURRENCY)]
        await load.kill_now.wait()
        before_kill = await asyncio.to_thread(requests_by_worker, gateway)
        victim = first[0]
        victim.send_signal(signal.SIGKILL)
        await asyncio.gather(*senders)

        async def replaced() -> bool:
            now = workers(gateway)
            return len(now) == 2 and victim.pid not in {p.pid for p in now}

        assert await poll(replaced, 30), "the killed worker was not replaced"
        answered_ids = set(load.answered.values())

        async def all_stored() -> bool:
            return answered_ids <= {row["id"] for row in await stored_calls(database_url)}

        assert await poll(all_stored, REPLAY_TIMEOUT_S), "answered calls were not stored"
        tree = family_tree(gateway)
        assert await terminate(gateway) == 0
        assert await gone(tree), [p.cmdline() for p in tree if p.is_running()]
        return load, tree, before_kill

    load, _, before_kill = asyncio.run(scenario())

    # Both workers served, and one scrape reported both (each counts its own calls, labelled).
    assert set(before_kill) == {"0", "1"} and min(before_kill.values()) > 0, before_kill
    assert sum(before_kill.values()) >= CALLS // 2
    assert len(load.answered) + len(load.failed) == CALLS
    assert len(load.failed) <= CONCURRENCY, load.failed  # only calls in flight on the killed worker
    rows = asyncio.run(stored_calls(database_url))
    by_id = {row["id"]: row for row in rows}
    for job, request_id in load.answered.items():
        assert (by_id[request_id]["text"], by_id[request_id]["status"]) == (job_text(job), "ok")
    repeated = {text: n for text, n in Counter(row["text"] for row in rows).items() if n > 1}
    assert not repeated, f"calls stored more than once: {repeated}"


@pytest.mark.slow
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_workers_stop_with_a_killed_parent_and_store_what_they_answered(
    gateway: GatewayProcess, database_url: str, tmp_path: Path
) -> None:
    """A SIGKILLed parent cannot stop its workers itself: the kernel tells them (SIGTERM), and each finishes
    and stores what it answered. A single gateway on the same data then finds everything stored. Nor can it
    remove the workers' socket directory: the last worker to go does."""

    async def scenario() -> set[str]:
        await start(gateway)
        load = Load(sdk(gateway))
        for job in range(60):
            load.jobs.put_nowait(job)
        await asyncio.gather(*(send(load, 10**9) for _ in range(4)))
        assert not load.failed, load.failed
        tree = family_tree(gateway)
        assert len([p for p in tree if "gateway.workers" in " ".join(p.cmdline())]) == 2
        assert len(peer_dirs(tmp_path)) == 1
        await kill(gateway)
        assert await gone(tree), [p.cmdline() for p in tree if p.is_running()]
        assert not peer_dirs(tmp_path), [sorted(d.iterdir()) for d in peer_dirs(tmp_path)]
        return set(load.answered.values())

    answered = asyncio.run(scenario())
    rows = asyncio.run(stored_calls(database_url))
    assert answered <= {row["id"] for row in rows}
    assert len(rows) == len({row["text"] for row in rows}) == 60


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_two_workers_share_one_vllm_that_comes_back_with_their_adapters(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "models").symlink_to(MODELS_DIR)
    gateway = GatewayProcess(
        data,
        "smollm2-135m-instruct",
        data / "gateway.log",
        {
            "KAIZEN_WORKERS": "2",
            "KAIZEN_VLLM_KV_CACHE_GIB": "1",
            "KAIZEN_VLLM_PORT": "0",
            "KAIZEN_SCHEDULER": "false",
            "KAIZEN_POLICY_REFRESH_S": "0.5",
            "KAIZEN_LOG_LEVEL": "info",
        },
    )

    def vllm_servers() -> list[psutil.Process]:
        return [
            p
            for p in psutil.process_iter(["cmdline"])
            if "vllm.entrypoints.openai.api_server" in " ".join(p.info["cmdline"] or [])
            and str(data / "models") in " ".join(p.info["cmdline"] or [])
        ]

    async def chat(client: httpx.AsyncClient, model: str) -> str:
        response = await client.post(
            gateway.url + "/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4},
        )
        assert response.status_code == 200, response.text
        return response.headers["x-kaizen-model"]

    async def scenario() -> None:
        gateway.start()
        await gateway.wait_ready(timeout_s=600)
        assert len(workers(gateway)) == 2
        [server] = vllm_servers()  # one engine for both workers, started by the parent
        assert gateway.process is not None and server.ppid() == gateway.process.pid
        await gateway.create_policy("bot")
        limits = httpx.Limits(max_keepalive_connections=0)
        headers = {"Authorization": f"Bearer {gateway.api_key}"}
        async with httpx.AsyncClient(timeout=120, limits=limits, headers=headers) as client:

            async def everywhere() -> bool:  # the other worker learns of the policy within its refresh
                try:
                    return set(await asyncio.gather(*(chat(client, "bot") for _ in range(8)))) == {"bot@0"}
                except AssertionError:
                    return False

            assert await poll(everywhere, 60, every_s=0.5), "bot@0 was not served by both workers"

            async def both_served() -> bool:  # connections are spread over the workers by the kernel
                await asyncio.gather(chat(client, "bot"), chat(client, "bot"))
                return len(requests_by_worker(gateway)) == 2

            assert await poll(both_served, 120), "one worker served every call"

            async def adopted() -> bool:  # the parent reads the server's adapters every ADOPT_INTERVAL_S
                return "the engine holds adapters bot@0" in gateway.log_path.read_text()

            assert await poll(adopted, 30), "the parent did not learn the workers' adapter"
            os.killpg(server.pid, signal.SIGKILL)

            async def back() -> bool:
                try:
                    return await chat(client, "bot") == "bot@0"
                except AssertionError:
                    return False

            assert await poll(back, 300, every_s=2), "the restarted engine did not serve bot@0"
            [restarted] = vllm_servers()
            assert restarted.pid != server.pid
            served = await asyncio.gather(*(chat(client, "bot") for _ in range(8)))
            assert set(served) == {"bot@0"}
        # SIGKILL of the parent: no shutdown code runs, yet the workers and the engine (its own session, its
        # engine-core processes) go with it.
        tree = [*family_tree(gateway), *psutil.Process(restarted.pid).children(recursive=True)]
        assert restarted in tree
        await kill(gateway)
        assert await gone(tree, 60), [p.cmdline() for p in tree if p.is_running()]

    try:
        asyncio.run(scenario())
    finally:
        gateway.stop()
    assert not vllm_servers()


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_no_worker_serves_an_episode_whose_turn_another_worker_still_holds(
    tmp_path: Path, upstream: ScriptedUpstream, database_url: str
) -> None:
    """An agent's turns may be answered by either worker, and its episode read through either: while one worker's
    capture queue still holds a turn (about 3 s here), every worker answers the episode 409, never a 404 before
    its first turn is stored nor half of it after."""
    gateway = upstream_gateway(
        tmp_path / "data",
        database_url,
        upstream.url,
        {"KAIZEN_WORKERS": "2", "KAIZEN_CAPTURE_FLUSH_MS": "3000"},
    )
    headers = {"authorization": f"Bearer {gateway.api_key}"}

    def read() -> httpx.Response:  # a connection of its own: it lands on either worker
        return httpx.get(f"{gateway.url}/v1/episodes/agent-run", headers=headers, timeout=10)

    async def reads_until_served() -> tuple[list[int], int]:
        """The status of every read until the episode is served, and how many turns it was served with."""
        statuses: list[int] = []
        turns = 0

        async def served() -> bool:
            nonlocal turns
            answer = await asyncio.to_thread(read)
            statuses.append(answer.status_code)
            if answer.status_code == 200:
                turns = len(answer.json()["turns"])
            return answer.status_code == 200

        assert await poll(served, 30, every_s=0.1), f"the episode was never served: {statuses}"
        return statuses, turns

    async def scenario() -> list[tuple[list[int], int]]:
        await start(gateway)
        try:
            client = sdk(gateway).with_options(default_headers={"x-episode-id": "agent-run"})
            reads = []
            for text in ("plan", "act"):
                await client.chat.completions.create(
                    model="scripted-1", messages=[{"role": "user", "content": text}]
                )
                reads.append(await reads_until_served())
            return reads
        finally:
            await terminate(gateway)

    # Every read through either worker, until the turn just made was stored, was refused: none was served short.
    for turns, (statuses, served_with) in enumerate(asyncio.run(scenario()), start=1):
        assert served_with == turns and set(statuses[:-1]) == {409} and statuses[-1] == 200, (turns, statuses)
