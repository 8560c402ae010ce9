"""A rolling upgrade under traffic, as docs/operations.md describes it: gateways of version N serve behind one
address (a load balancer) on one PostgreSQL; `kaizen db upgrade` of version N+1 migrates the database while
calls flow; the N gateways keep answering and capturing on the migrated schema; gateways of N+1 start beside them;
then the N gateways are drained and stopped with SIGTERM, one at a time. No call may fail and every answered call
must be stored exactly once.

N is the commit just before the newest migration was added (its schema is one revision behind), unpacked with
`git archive` and run on this checkout's environment; N+1 is this checkout. The load balancer is a layer-4 proxy
(tests/support/tcp_balancer.py) that drains a backend's connections before it is stopped, as a production one does.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from alembic.script import ScriptDirectory

from gateway.commands.serve_process import GatewayProcess
from migrations.runner import Migration, alembic_config
from tests.support.older_tree import ROOT, check_tree, git, tree_paths, unpack
from tests.support.polling import wait_until_async
from tests.support.postgres import PostgresServer
from tests.support.scripted_upstream import ScriptedUpstream
from tests.support.sql import fetch_rows
from tests.support.tcp_balancer import Backend, TcpBalancer

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.timeout(900)]

CONCURRENCY = 4
API_KEY = secrets.token_hex(16)
#: Calls answered between the steps: enough for every replica in the rotation to take some.
STEP_CALLS = 40


@dataclass(frozen=True)
class Versions:
    previous: str  # the commit of version N
    head: Migration  # the migration N+1 adds


def versions() -> Versions:
    """N: the commit before the newest migration was added (this checkout's HEAD while it is not committed yet)."""
    script = ScriptDirectory.from_config(alembic_config("postgresql+asyncpg://"))
    newest = script.get_revision("head")
    assert newest is not None and newest.path is not None
    path = Path(newest.path).relative_to(ROOT).as_posix()
    added = git("log", "--diff-filter=A", "--format=%H", "--", path).splitlines()
    previous = git("rev-parse", f"{added[-1]}^" if added else "HEAD")
    files = git("ls-tree", "--name-only", previous, "migrations/versions/").splitlines()
    assert path not in files and any(
        f.startswith(f"migrations/versions/{newest.down_revision}_") for f in files
    )
    # N runs on this checkout's environment: it must pin what this one does.
    assert (
        git("show", f"{previous}:requirements/app.txt") == (ROOT / "requirements/app.txt").read_text().strip()
    ), f"requirements/app.txt changed since {previous[:12]}: this environment may not run version N"
    return Versions(previous, Migration.of(newest))


@dataclass
class Traffic:
    """Calls through the load balancer at a fixed concurrency, each a new connection (as a load balancer spreads
    requests), until `stop` is set. Every call that is not a 200 with its own reply is a failure."""

    url: str
    answered: dict[str, str] = field(
        default_factory=dict
    )  # the client's x-request-id -> the gateway's call id
    failures: list[str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        limits = httpx.Limits(max_keepalive_connections=0)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=self.url, timeout=60, limits=limits, headers=headers) as client:
            await asyncio.gather(*(self._caller(client) for _ in range(CONCURRENCY)))

    async def _caller(self, client: httpx.AsyncClient) -> None:
        while not self.stop.is_set():
            sent = uuid.uuid4().hex
            body = {"model": "scripted-1", "messages": [{"role": "user", "content": f"call {sent}"}]}
            try:
                reply = await client.post("/v1/chat/completions", json=body, headers={"x-request-id": sent})
            except httpx.HTTPError as exc:
                self.failures.append(f"{sent}: {exc!r}")
                continue
            if (
                reply.status_code != 200
                or reply.json()["choices"][0]["message"]["content"] != f"echo: call {sent}"
            ):
                self.failures.append(f"{sent}: {reply.status_code} {reply.text[:300]}")
                continue
            self.answered[sent] = reply.headers["x-request-id"]

    async def more(self, count: int, what: str) -> None:
        target = len(self.answered) + count
        await until(lambda: len(self.answered) >= target, f"{count} more calls answered {what}")


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 180) -> None:
    async def holds() -> bool:
        return condition()

    await wait_until_async(holds, what, timeout_s=timeout_s)


def replica(
    name: str, data_dir: Path, database_url: str, upstream: ScriptedUpstream, tree: Path | None
) -> GatewayProcess:
    """A gateway replica: one database, one data directory and the same keys as its peers; `tree`: the code of an
    older version (None: this checkout)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    env = {
        "KAIZEN_ENGINE": "upstream",
        "KAIZEN_UPSTREAM_URL": upstream.url,
        "KAIZEN_UPSTREAM_TOKEN_IDS": "true",
        "KAIZEN_DATABASE_URL": database_url,
        "KAIZEN_API_KEYS": API_KEY,
        "KAIZEN_SCHEDULER": "false",
        "KAIZEN_LOG_LEVEL": "info",
        **(tree_paths(tree) if tree else {}),
    }
    gateway = GatewayProcess(data_dir, "scripted-1", data_dir / f"{name}.log", env)
    gateway.api_key = API_KEY
    return gateway


def port_of(gateway: GatewayProcess) -> int:
    return int(gateway.url.rsplit(":", 1)[1])


async def stored(database_url: str, sent: list[str]) -> list[tuple[str, str]]:
    """(client request id, call id) of every stored call among those sent."""
    rows = await fetch_rows(
        database_url,
        "SELECT client_request_id, id FROM calls WHERE client_request_id = ANY(:sent)",
        sent=sent,
    )
    return sorted((r["client_request_id"], r["id"]) for r in rows)


def test_a_rolling_upgrade_under_traffic_fails_no_call_and_loses_no_capture(
    postgres: PostgresServer, upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    chosen = versions()
    if not chosen.head.safety.safe_on("postgresql"):
        pytest.skip(
            f"the newest migration, {chosen.head.revision}, needs the gateways stopped: no rolling upgrade"
        )
    old_tree = tmp_path / "version-n"
    unpack(chosen.previous, old_tree)
    check_tree(old_tree)
    database_url = postgres.create_database("rolling_" + uuid.uuid4().hex[:8])
    data = tmp_path / "data"
    old = [replica(f"n-{i}", data, database_url, upstream, old_tree) for i in range(2)]
    new = [replica(f"n1-{i}", data, database_url, upstream, None) for i in range(2)]

    async def serve(gateways: list[GatewayProcess], balancer: TcpBalancer, version: str) -> list[Backend]:
        for gateway in gateways:
            gateway.start()
        await asyncio.gather(*(gateway.wait_ready(timeout_s=180) for gateway in gateways))
        return [balancer.add(f"{version} {port_of(g)}", port_of(g)) for g in gateways]

    async def scenario() -> tuple[Traffic, list[Backend], list[Backend], str]:
        balancer = await TcpBalancer().start()
        traffic = Traffic(balancer.url)
        try:
            old_backends = await serve(old, balancer, "N")
            calls = asyncio.create_task(traffic.run())
            await traffic.more(STEP_CALLS, "by version N")

            # The migration, while version N serves.
            upgrade = await asyncio.create_subprocess_exec(
                *[sys.executable, "-m", "gateway", "db", "upgrade", "--database-url", database_url],
                *["--data-dir", str(data)],
                cwd=ROOT,
                env={k: v for k, v in os.environ.items() if not k.startswith("KAIZEN_")},
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            answered_before = len(traffic.answered)
            _, err = await upgrade.communicate()
            upgrade_log = err.decode()
            assert upgrade.returncode == 0, upgrade_log
            assert len(traffic.answered) > answered_before  # calls were answered while it ran

            # Version N on the migrated schema: it answers, and its writers store what it answered.
            since = len(traffic.answered)
            served = [b.served for b in old_backends]
            await until(
                lambda: all(b.served >= s + 10 for b, s in zip(old_backends, served, strict=True)), "N"
            )
            by_old_code = dict(list(traffic.answered.items())[since:])
            await wait_for_storage(database_url, by_old_code, "calls version N answered after the migration")

            # Version N+1 beside it, then N drained and stopped, one replica at a time.
            new_backends = await serve(new, balancer, "N+1")
            served = [b.served for b in new_backends]
            await until(
                lambda: all(b.served >= s + 5 for b, s in zip(new_backends, served, strict=True)), "N+1"
            )
            for gateway, backend in zip(old, old_backends, strict=True):
                await balancer.drain(backend)
                assert gateway.process is not None
                gateway.process.send_signal(signal.SIGTERM)
                status = await asyncio.to_thread(gateway.process.wait, 90)
                assert status in (0, -signal.SIGTERM), gateway.log_path.read_text()[-3000:]
                await traffic.more(STEP_CALLS // 2, f"after {backend.name} stopped")

            traffic.stop.set()
            await calls
            return traffic, old_backends, new_backends, upgrade_log
        finally:
            traffic.stop.set()
            await balancer.close()

    try:
        traffic, old_backends, new_backends, upgrade_log = asyncio.run(scenario())
        assert traffic.failures == []
        asyncio.run(wait_for_storage(database_url, traffic.answered, "every answered call"))
    finally:
        for gateway in old + new:
            gateway.stop()

    # Exactly once: one row per call sent, under the id its reply carried.
    assert asyncio.run(stored(database_url, list(traffic.answered))) == sorted(traffic.answered.items())
    assert all(b.served > 0 for b in old_backends + new_backends)
    assert f"  {chosen.head.revision} ({chosen.head.title}): online-safe" in upgrade_log
    for gateway in new:  # the database was current when they started
        assert f"is at revision {chosen.head.revision}: nothing to apply" in gateway.log_path.read_text()


async def wait_for_storage(database_url: str, answered: dict[str, str], what: str) -> None:
    sent = list(answered)

    async def all_stored() -> bool:
        return len(await stored(database_url, sent)) >= len(sent)

    await wait_until_async(all_stored, what, timeout_s=120, every_s=0.2)
