"""Operational faults against a real gateway: the database going away under load, the engine killed
mid-stream, clients leaving before the reply, and what readiness and error answers say meanwhile."""

from __future__ import annotations

import asyncio
import logging
import socket
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.auth import create_key
from gateway.settings import async_database_url
from migrations.runner import upgrade_database_sync
from storage.database import Database
from tests.conftest import query
from tests.integration.test_keys_and_tenancy import bearer
from tests.support.gateway_server import GatewayServer
from tests.support.openai_schema import validate
from tests.support.polling import wait_until
from tests.support.ports import free_port
from tests.support.postgres import PostgresServer
from tests.support.upstream_process import UpstreamProcess

log = logging.getLogger(__name__)
MakeGateway = Callable[..., GatewayServer]
ADMIN_KEY = "admin-faults"
CONCURRENCY = 8


def client(gw: GatewayServer, timeout_s: float = 20.0) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=timeout_s)


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    validate("ErrorResponse", response.json())
    error: dict[str, Any] = response.json()["error"]
    return error


class Load:
    """CONCURRENCY threads calling chat completions until stopped; remembers every answered call's id."""

    def __init__(self, gw: GatewayServer) -> None:
        self.sdk = client(gw)
        self.answered: list[str] = []
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(CONCURRENCY)
        self._futures = [self._pool.submit(self._run, i) for i in range(CONCURRENCY)]

    def _run(self, worker: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            try:
                raw = self.sdk.chat.completions.with_raw_response.create(
                    model="scripted-1", messages=[{"role": "user", "content": f"load {worker} {n}"}]
                )
                raw.parse()
                with self._lock:
                    self.answered.append(raw.headers["x-request-id"])
            except openai.APIError as exc:
                with self._lock:
                    self.failed.append(str(exc))

    def count(self) -> int:
        with self._lock:
            return len(self.answered)

    def stop(self) -> None:
        self._stop.set()
        for future in self._futures:
            future.result(timeout=60)
        self._pool.shutdown()


def assert_each_answered_call_stored_once(gw: GatewayServer, url: str, answered: list[str]) -> None:
    """Poll until the spool is replayed, then every answered call is in `calls` exactly once."""

    def replayed() -> bool:
        snapshot = gw.services.sink.snapshot()
        if snapshot["queue_depth"] or snapshot["spool_bytes"]:
            return False
        return query(url, "SELECT count(*) AS n FROM calls")[0]["n"] >= len(answered)

    wait_until(replayed, "the capture spool to be replayed", timeout_s=90)
    rows = query(url, "SELECT id, count(*) AS n FROM calls GROUP BY id")
    log.info("%d calls answered, %d rows in calls", len(answered), sum(row["n"] for row in rows))
    assert all(row["n"] == 1 for row in rows)
    assert len(answered) == len(set(answered))
    assert {row["id"] for row in rows} == set(answered)


def feedback(gw: GatewayServer, request_id: str, key: str) -> httpx.Response:
    body = {"request_id": request_id, "value": 1.0, "idempotency_key": key}
    return httpx.post(gw.url + "/v1/feedback", json=body, timeout=60)


def stored_feedback(url: str, key: str) -> int:
    rows = query(url, "SELECT count(*) AS n FROM rewards WHERE idempotency_key = :k", k=key)
    return int(rows[0]["n"])


@contextmanager
def stopped(server: PostgresServer) -> Iterator[None]:
    server.stop()
    try:
        yield
    finally:
        server.start()
        server.wait_ready()


@pytest.mark.slow
def test_postgres_stopped_and_restarted_under_load(
    make_gateway: MakeGateway, postgres: PostgresServer
) -> None:
    url = postgres.create_database("outage_" + uuid.uuid4().hex[:8])
    gw = make_gateway(url, admin_key=ADMIN_KEY)
    first = client(gw).chat.completions.with_raw_response.create(
        model="scripted-1", messages=[{"role": "user", "content": "before"}]
    )
    first_id = first.headers["x-request-id"]
    first_episode = first.headers["x-episode-id"]
    gw.flush()
    load = Load(gw)
    answered_during: int
    try:
        wait_until(lambda: load.count() >= 20, "calls before the outage", timeout_s=60)
        with stopped(postgres):
            at_stop = load.count()
            wait_until(lambda: load.count() >= at_stop + 30, "calls answered during the outage", timeout_s=60)
            answered_during = load.count() - at_stop
            ready = httpx.get(gw.url + "/readyz", timeout=30)
            assert ready.status_code == 200, ready.text
            assert ready.json()["database"] is False and ready.json()["engine"] is True
            episode = httpx.get(gw.url + f"/v1/episodes/{first_episode}", timeout=30)
            assert assert_openai_error(episode, 503)["code"] == "database_unavailable"
            assert int(episode.headers["retry-after"]) >= 1
            policies = httpx.get(
                gw.url + "/admin/policies", headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=30
            )
            assert_openai_error(policies, 503)
            assert "retry-after" in policies.headers
            during = feedback(gw, first_id, "fb-outage")
            assert during.status_code in (200, 503), during.text
            if during.status_code == 503:
                assert_openai_error(during, 503)
    finally:
        load.stop()
    log.info("answered during the outage: %d; feedback during it: %d", answered_during, during.status_code)
    assert load.failed == []
    assert answered_during >= 30
    answered = [first_id, *load.answered]
    assert_each_answered_call_stored_once(gw, url, answered)
    for _ in range(2):  # the retry, and a duplicate of it
        assert feedback(gw, first_id, "fb-outage").status_code == 200
    assert stored_feedback(url, "fb-outage") == 1
    assert httpx.get(gw.url + "/readyz").json()["database"] is True


def test_sqlite_locked_under_load(make_gateway: MakeGateway, tmp_path: Path) -> None:
    path = tmp_path / "locked.db"
    url = f"sqlite:///{path}"
    gw = make_gateway(url)
    first = client(gw).chat.completions.with_raw_response.create(
        model="scripted-1", messages=[{"role": "user", "content": "before"}]
    )
    first_id = first.headers["x-request-id"]
    gw.flush()
    load = Load(gw)
    try:
        wait_until(lambda: load.count() >= 20, "calls before the lock", timeout_s=60)
        lock = sqlite3.connect(path, timeout=30, isolation_level=None)
        lock.execute("BEGIN EXCLUSIVE")
        try:
            at_lock = load.count()
            wait_until(
                lambda: load.count() >= at_lock + 30,
                "calls answered while the database is locked",
                timeout_s=60,
            )
            answered_during = load.count() - at_lock
            assert httpx.get(gw.url + "/readyz", timeout=30).status_code == 200
        finally:
            lock.execute("COMMIT")
            lock.close()
        during = feedback(gw, first_id, "fb-locked")
        assert during.status_code in (200, 503), during.text
    finally:
        load.stop()
    log.info("answered while locked: %d; feedback after it: %d", answered_during, during.status_code)
    assert load.failed == []
    assert answered_during >= 30
    assert_each_answered_call_stored_once(gw, url, [first_id, *load.answered])
    for _ in range(2):
        assert feedback(gw, first_id, "fb-locked").status_code == 200
    assert stored_feedback(url, "fb-locked") == 1


@pytest.fixture
def upstream_process() -> Iterator[UpstreamProcess]:
    process = UpstreamProcess().start()
    yield process
    process.kill()


def test_engine_killed_mid_stream(
    make_gateway: MakeGateway, database_url: str, upstream_process: UpstreamProcess
) -> None:
    gw = make_gateway(database_url, upstream_url=upstream_process.url, engine_timeout_s=30)
    sdk = client(gw, timeout_s=30)
    streams = 4
    started = threading.Barrier(streams + 1, timeout=60)
    outcomes: dict[str, str] = {}

    def one(i: int) -> None:
        raw = sdk.chat.completions.with_raw_response.create(
            model="scripted-1",
            messages=[{"role": "user", "content": f"#long 400 #slow 20 s{i}"}],
            stream=True,
        )
        call_id = raw.headers["x-request-id"]
        chunks = iter(raw.parse())
        next(chunks)
        started.wait()
        try:
            for _ in chunks:
                pass
            outcomes[call_id] = "completed"
        except openai.APIError as exc:
            outcomes[call_id] = f"error: {exc}"

    began = time.monotonic()
    with ThreadPoolExecutor(streams) as pool:
        futures = [pool.submit(one, i) for i in range(streams)]
        started.wait()
        upstream_process.kill()
        for future in futures:
            future.result(timeout=60)
    log.info("streams began and ended within %.2f s: %s", time.monotonic() - began, outcomes)
    assert time.monotonic() - began < 30  # clean ends, no client waited out a timeout
    assert len(outcomes) == streams
    assert all(outcome.startswith("error") for outcome in outcomes.values()), outcomes
    assert all(str(upstream_process.port) not in outcome for outcome in outcomes.values())

    upstream_process.start()

    def serves() -> bool:
        try:
            sdk.chat.completions.create(model="scripted-1", messages=[{"role": "user", "content": "back"}])
        except openai.APIError:
            return False
        return True

    wait_until(serves, "calls to succeed once the engine is back", timeout_s=60)
    gw.flush()
    rows = query(database_url, "SELECT id, status FROM calls")
    killed = [row for row in rows if row["id"] in outcomes]
    assert sorted(row["id"] for row in killed) == sorted(outcomes)
    assert {row["status"] for row in killed} == {"error"}
    assert len(rows) == len({row["id"] for row in rows})
    assert any(row["status"] == "ok" for row in rows)


def test_engine_down_answers_503_without_its_address(make_gateway: MakeGateway, tmp_path: Path) -> None:
    port = free_port()
    gw = make_gateway(f"sqlite:///{tmp_path / 'k.db'}", upstream_url=f"http://127.0.0.1:{port}/v1")
    response = httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": "scripted-1", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert response.status_code in (404, 503), response.text
    error = assert_openai_error(response, response.status_code)
    assert str(port) not in error["message"] and "127.0.0.1" not in error["message"]
    ready = httpx.get(gw.url + "/readyz")
    assert ready.status_code == 503
    assert ready.json() == {
        "status": "not_ready",
        "engine": False,
        "database": True,
        "keys": True,
        "policies": True,
        "capture": "log",
    }


def test_a_gateway_that_could_not_read_its_keys_refuses_calls_until_it_has(
    make_gateway: MakeGateway, postgres: PostgresServer
) -> None:
    """PostgreSQL stops while the gateway waits for its engine, before it reads its keys and policies: it must
    not take the empty key ring for an open one, nor serve calls without the policies' privacy sections. Both
    are refused with 503 until the database is back."""
    url = postgres.create_database("keys_" + uuid.uuid4().hex[:8])
    upgrade_database_sync(async_database_url(url))
    secret = asyncio.run(managed_key(async_database_url(url)))
    engine = UpstreamProcess()  # started once the gateway is seen waiting for it
    chat = {"model": "scripted-1", "messages": [{"role": "user", "content": "hi"}]}
    with ThreadPoolExecutor(1) as pool, socket.create_server(("127.0.0.1", engine.port)) as listener:
        starting = pool.submit(
            make_gateway, url, engine="vllm", vllm_url=engine.url, admin_key=ADMIN_KEY, policy_refresh_s=0.3
        )
        listener.settimeout(60)
        listener.accept()[0].close()  # the gateway's first engine health check: it is past its schema upgrade
        listener.close()
        try:
            with stopped(postgres):
                engine.start()
                gw = starting.result(timeout=120)
                for headers in ({}, bearer(secret), bearer("kz-guess")):
                    response = httpx.post(
                        gw.url + "/v1/chat/completions", json=chat, headers=headers, timeout=30
                    )
                    assert assert_openai_error(response, 503)["code"] == "keys_unavailable"
                    assert int(response.headers["retry-after"]) >= 1
                admin = httpx.post(  # the admin key is not in the database: it works, and meets the policies
                    gw.url + "/v1/chat/completions", json=chat, headers=bearer(ADMIN_KEY), timeout=30
                )
                assert assert_openai_error(admin, 503)["code"] == "policies_unavailable"
                # Guesses at the admin key meet the throttle meanwhile: unknown is not yet wrong, but it counts.
                guesses = [
                    httpx.get(gw.url + "/admin/audit", headers=bearer(f"guess-{i}"), timeout=30).status_code
                    for i in range(5)
                ]
                assert guesses == [503] * 5
                throttled = httpx.get(gw.url + "/admin/audit", headers=bearer(ADMIN_KEY), timeout=30)
                assert assert_openai_error(throttled, 429)["code"] == "too_many_failed_logins"
                ready = httpx.get(gw.url + "/readyz", timeout=30)
                assert ready.status_code == 503
                assert ready.json() == {
                    "status": "not_ready",
                    "engine": True,
                    "database": False,
                    "keys": False,
                    "policies": False,
                    "capture": "log",
                }
            wait_until(lambda: httpx.get(gw.url + "/readyz").status_code == 200, "the keys to be read", 60)
            refused = httpx.post(gw.url + "/v1/chat/completions", json=chat, timeout=30)
            assert assert_openai_error(refused, 401)["code"] == "invalid_api_key"
            served = httpx.post(
                gw.url + "/v1/chat/completions", json=chat, headers=bearer(secret), timeout=30
            )
            assert served.status_code == 200, served.text
            assert_each_answered_call_stored_once(gw, url, [served.headers["x-request-id"]])
        finally:
            engine.kill()


async def managed_key(url: str) -> str:
    database = Database(url)
    try:
        async with database.session() as session:
            _, secret = await create_key(session, "app", ["chat"])
            await session.commit()
    finally:
        await database.dispose()
    return secret


def test_client_leaving_before_the_reply_is_recorded_as_a_disconnect(
    make_gateway: MakeGateway, database_url: str
) -> None:
    gw = make_gateway(database_url)
    client_id = "left-" + uuid.uuid4().hex[:12]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            gw.url + "/v1/chat/completions",
            json={"model": "scripted-1", "messages": [{"role": "user", "content": "#slow 1500 hi"}]},
            headers={"x-request-id": client_id},
            timeout=httpx.Timeout(10, read=0.3),
        )

    def recorded() -> bool:
        gw.flush()
        return bool(query(database_url, "SELECT id FROM calls WHERE client_request_id = :i", i=client_id))

    wait_until(recorded, "the abandoned call to be recorded", timeout_s=30)
    [row] = query(
        database_url, "SELECT status, response FROM calls WHERE client_request_id = :i", i=client_id
    )
    assert row["status"] == "client_disconnected"
    assert row["response"] is None
