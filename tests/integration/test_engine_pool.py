"""One gateway over two engine replicas attached by URL (`KAIZEN_VLLM_URL=u1,u2`): calls spread over both, a
promotion is loaded on every replica before it is served, and a replica SIGKILLed under load is taken out, its
calls that had not started answering are retried on the other, and nothing the clients were answered is lost or
stored twice. The replicas are scripted upstreams in their own processes (so they can be killed and restarted on
their port); `test_engine_replicas.py` does the same with two real vLLM servers."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.settings import async_database_url
from storage.database import Database
from storage.policies import activate_version, adapter_dir, add_adapter, create_policy, get_policy
from tests.support.engine_faults import load_with_a_kill
from tests.support.gateway_server import GatewayServer
from tests.support.polling import wait_until
from tests.support.sql import fetch_rows
from tests.support.upstream_process import UpstreamProcess

MakeGateway = Callable[..., GatewayServer]
CALLS = 60
CONCURRENCY = 8


@pytest.fixture
def replicas() -> Iterator[list[UpstreamProcess]]:
    started = [UpstreamProcess().start(), UpstreamProcess().start()]
    yield started
    for replica in started:
        replica.kill()


def engine_state(gateway: GatewayServer) -> dict[str, Any]:
    response = httpx.get(gateway.url + "/admin/engine", headers={"Authorization": "Bearer adm"}, timeout=10)
    assert response.status_code == 200, response.text
    return dict(response.json())


def loaded(replica: UpstreamProcess) -> set[str]:
    models = httpx.get(replica.url + "/models", timeout=10).json()["data"]
    return {m["id"] for m in models}


def register_versions(database_url: str, data_dir: Path, versions: int) -> None:
    async def register() -> None:
        database = Database(async_database_url(database_url))
        try:
            async with database.session() as session:
                policy = await create_policy(session, "bot", "scripted-1", {"schedule": {"paused": True}})
                for version in range(versions):
                    path = adapter_dir(data_dir, "bot", version)
                    path.mkdir(parents=True)
                    await add_adapter(session, policy.id, version, str(path), status="candidate")
                await activate_version(session, policy.id, 0)
                await session.commit()
        finally:
            await database.dispose()

    asyncio.run(register())


def promote(database_url: str, version: int) -> None:
    async def activate() -> None:
        database = Database(async_database_url(database_url))
        try:
            async with database.session() as session:
                policy = await get_policy(session, "bot")
                assert policy is not None
                await activate_version(session, policy.id, version)
                await session.commit()
        finally:
            await database.dispose()

    asyncio.run(activate())


def served_version(gateway: GatewayServer) -> str:
    response = httpx.post(
        gateway.url + "/v1/chat/completions",
        json={"model": "bot", "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    return str(response.headers.get("x-kaizen-model", response.status_code))


def pool_gateway(
    make_gateway: MakeGateway, database_url: str, replicas: list[UpstreamProcess]
) -> GatewayServer:
    """A gateway attached to the replicas as vLLM servers."""
    return make_gateway(
        database_url,
        engine="vllm",
        vllm_url=",".join(r.url for r in replicas),
        base_model="scripted-1",
        admin_key="adm",
        policy_refresh_s=0.3,
    )


def test_calls_spread_and_a_promotion_reaches_every_replica(
    make_gateway: MakeGateway, database_url: str, replicas: list[UpstreamProcess], tmp_path: Path
) -> None:
    gateway = pool_gateway(make_gateway, database_url, replicas)
    register_versions(database_url, gateway.settings.data_dir, 2)
    wait_until(lambda: served_version(gateway) == "bot@0", "bot@0 to be served")
    assert all("bot@0" in loaded(r) for r in replicas)

    async def burst() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            body = {"model": "bot", "messages": [{"role": "user", "content": "#slow 30"}]}
            await asyncio.gather(
                *(client.post(gateway.url + "/v1/chat/completions", json=body) for _ in range(20))
            )

    asyncio.run(burst())
    served = [r["served"] for r in engine_state(gateway)["replicas"]]
    assert min(served) >= 5, served  # least-loaded: concurrent calls go to both

    promote(database_url, 1)
    wait_until(lambda: served_version(gateway) == "bot@1", "bot@1 to be served")
    # The router switched only after the pool had loaded the version on every replica.
    assert all("bot@1" in loaded(r) for r in replicas)


@pytest.mark.slow
def test_a_replica_killed_under_load_loses_no_call(
    make_gateway: MakeGateway, database_url: str, replicas: list[UpstreamProcess], tmp_path: Path
) -> None:
    gateway = pool_gateway(make_gateway, database_url, replicas)
    register_versions(database_url, gateway.settings.data_dir, 1)
    wait_until(lambda: served_version(gateway) == "bot@0", "bot@0 to be served")
    doomed, survivor = replicas

    def body(n: int) -> dict[str, Any]:
        stream = n % 2 == 1
        # About 300 ms either way (a stream waits before each chunk), so calls are in flight when it dies.
        script = "#long 12 #slow 25" if stream else "#long 12 #slow 300"
        return {
            "model": "bot",
            "stream": stream,
            "messages": [{"role": "user", "content": f"call {n} {script}"}],
        }

    async def kill() -> None:
        await asyncio.to_thread(doomed.kill)  # SIGKILL, calls in flight on it

    seen = asyncio.run(load_with_a_kill(gateway.url, body, CALLS, CONCURRENCY, kill, timeout_s=60))
    outcomes, answered, broken = seen.counts, seen.answered, seen.broken
    state = engine_state(gateway)
    assert [r["routable"] for r in state["replicas"]] == [False, True], state
    assert sum(outcomes.values()) == CALLS
    # A non-streamed call never reached its client half-done, so every one of them was retried and answered;
    # only streams already relaying when their replica died could not be.
    assert set(outcomes) <= {"complete", "stream broken mid-way"}, outcomes
    assert outcomes["stream broken mid-way"] == state["failed_mid_stream"]
    assert state["retried"] + state["failed_mid_stream"] >= 1, state  # calls were in flight on it

    async def rows() -> list[dict[str, Any]]:
        return await fetch_rows(gateway.settings.database_url, "SELECT id, status FROM calls")

    gateway.flush()
    stored = asyncio.run(rows())
    statuses = {r["id"]: r["status"] for r in stored}
    assert len(stored) == CALLS + 1  # every call once (plus the probe that waited for bot@0)
    assert all(statuses[i] == "ok" for i in answered)
    assert all(statuses[i] == "error" for i in broken)

    # Back on its port, the replica gets the adapters it lost before it takes calls again.
    doomed.start()
    wait_until(lambda: engine_state(gateway)["replicas"][0]["routable"], "the replica to be back", 30)
    assert "bot@0" in loaded(doomed)
    assert survivor.url != doomed.url
