"""Two real vLLM servers (CPU build, 1 GiB of KV cache each) supervised by one gateway: a policy's versions are
loaded on both before one is served, calls spread over both, and one replica SIGKILLed under load is taken out,
restarted by its watchdog and given its adapters back, with every answered call captured once."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.engines.pool import EnginePool
from gateway.policies import create_policy_with_initial_adapter
from gateway.settings import Settings
from storage.database import Database
from storage.policies import activate_version, adapter_dir, add_adapter, get_policy
from tests.conftest import MODELS_DIR, query
from tests.integration.test_vllm_engine import _write_random_adapter
from tests.support.engine_faults import load_with_a_kill
from tests.support.gateway_server import GatewayServer
from tests.support.polling import poll, wait_until

# Two vLLM servers start (and one restarts) on two shared cores: minutes on a loaded machine.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

CALLS = 24
CONCURRENCY = 4


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, embedded_model: Path) -> Iterator[GatewayServer]:
    data = tmp_path_factory.mktemp("two-vllm")
    (data / "models").symlink_to(MODELS_DIR)
    settings = Settings.load(
        data_dir=data,
        database_url=f"sqlite:///{data / 'kaizen.db'}",
        engine="vllm",
        vllm_replicas=2,
        vllm_kv_cache_gib=1,
        port=0,
        capture_flush_ms=5.0,
        policy_refresh_s=0.5,
        scheduler=False,
        admin_key="adm",
    )
    server = GatewayServer(settings, startup_timeout_s=1200).start()
    yield server
    server.stop()


def pool(gateway: GatewayServer) -> EnginePool:
    engine = gateway.services.engine
    assert isinstance(engine, EnginePool)
    return engine


def loaded(url: str) -> set[str]:
    return {m["id"] for m in httpx.get(url + "/models", timeout=30).json()["data"]}


def served_model(gateway: GatewayServer, model: str) -> str:
    response = httpx.post(
        gateway.url + "/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
        timeout=300,
    )
    return str(response.headers.get("x-kaizen-model", response.status_code))


def database_run(gateway: GatewayServer, coro: Any) -> Any:
    async def wrapped() -> Any:
        database = Database(gateway.settings.database_url)
        try:
            return await coro(database)
        finally:
            await database.dispose()

    return asyncio.run(wrapped())


def test_versions_are_on_both_replicas_before_they_are_served(gateway: GatewayServer) -> None:
    data = gateway.settings.data_dir

    async def create(database: Database) -> None:
        await create_policy_with_initial_adapter(
            database, data, "bot", "smollm2-135m-instruct", actor="tests"
        )

    database_run(gateway, create)
    wait_until(lambda: served_model(gateway, "bot") == "bot@0", "bot@0 to be served", 120)
    urls = [r.engine.base_url for r in pool(gateway).replicas]
    assert all("bot@0" in loaded(url) for url in urls)

    _write_random_adapter(adapter_dir(data, "bot", 0), adapter_dir(data, "bot", 1), seed=1)

    async def promote(database: Database) -> None:
        async with database.session() as session:
            policy = await get_policy(session, "bot")
            assert policy is not None
            await add_adapter(session, policy.id, 1, str(adapter_dir(data, "bot", 1)), parent_version=0)
            await activate_version(session, policy.id, 1)
            await session.commit()

    database_run(gateway, promote)
    wait_until(lambda: served_model(gateway, "bot") == "bot@1", "bot@1 to be served", 120)
    assert all("bot@1" in loaded(url) for url in urls)


def test_a_replica_killed_under_load_is_replaced_and_nothing_is_lost(gateway: GatewayServer) -> None:
    engines = pool(gateway)

    def body(n: int) -> dict[str, Any]:
        return {
            "model": "bot",
            "stream": n % 2 == 1,
            "max_tokens": 24,
            "messages": [{"role": "user", "content": f"Count from {n} to {n + 20}."}],
        }

    async def both_answered() -> bool:
        return all(r.served > before[r.engine.base_url] for r in engines.replicas)

    async def kill() -> None:
        # Not before each replica has answered a call of this load: a replica slowed by the machine may not
        # have finished one when a quarter of the calls are done, and then it would seem to have taken none.
        assert await poll(both_answered, timeout_s=600)
        doomed = engines.replicas[1].engine._process  # the API server; its engine core is in its group
        assert doomed is not None
        os.killpg(doomed.pid, signal.SIGKILL)

    before = {r.engine.base_url: r.served for r in engines.replicas}
    seen = asyncio.run(load_with_a_kill(gateway.url, body, CALLS, CONCURRENCY, kill, timeout_s=600))
    outcomes, answered, broken = seen.counts, seen.answered, seen.broken
    assert sum(outcomes.values()) == CALLS
    assert set(outcomes) <= {"complete", "stream broken mid-way"}, outcomes
    assert outcomes["stream broken mid-way"] == engines.failed_mid_stream
    assert all(r.served > before[r.engine.base_url] for r in engines.replicas)  # both took calls

    gateway.flush()
    rows = query(gateway.settings.database_url, "SELECT id, status FROM calls")
    statuses = {r["id"]: r["status"] for r in rows}
    assert all(statuses.get(i) == "ok" for i in answered), "an answered call was not captured"
    assert all(statuses.get(i) == "error" for i in broken)
    assert len(answered) + len(broken) == CALLS

    # The watchdog restarts the killed server; the pool gives it bot@1 back before it takes calls again. The
    # wait is for the restart to have finished: a kill near the end of the load can land after the last call,
    # while the pool still counts the replica as routable, and `restarts` counts a restart from when it begins.
    # The engine says itself ready again only once its server answers and has its adapters back; `restarts` is
    # read first, because the watchdog marks the engine not ready before it counts the restart.
    killed = engines.replicas[1]
    wait_until(
        lambda: (
            killed.engine.restarts >= 1
            and killed.engine.snapshot()["replicas"][0]["routable"]
            and killed.routable
        ),
        "the killed replica to be restarted and back",
        900,
    )
    assert "bot@1" in loaded(killed.engine.base_url)
    assert served_model(gateway, "bot") == "bot@1"
