"""Schema upgrades as an operator meets them: `kaizen db upgrade` lists what it would apply and refuses a migration
that is not online-safe until told the gateways are stopped; `kaizen serve` applies online-safe migrations itself
and refuses to start on an offline one; a gateway older than its database serves on it when every newer revision
was online-safe, and refuses when one was not. Real processes, real SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from gateway.commands.serve_process import GatewayProcess
from gateway.settings import async_database_url
from migrations import runner
from migrations.runner import MigrationRefused, upgrade_database
from storage.database import Database
from tests.conftest import query
from tests.support.child_gateway import sdk_chat, upstream_gateway
from tests.support.polling import wait_until
from tests.support.postgres import PostgresServer
from tests.support.scripted_upstream import ScriptedUpstream

REPO = Path(__file__).resolve().parents[2]
HEAD = "0023"
#: The revisions that need the gateways stopped, on each database.
OFFLINE = {"sqlite": ["0005"], "postgresql": ["0005", "0015", "0019"]}


def kaizen(url: str, data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAIZEN_")}
    command = [sys.executable, "-m", "gateway", *args, "--database-url", url, "--data-dir", str(data_dir)]
    return subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=180, check=False
    )


def revision(url: str) -> str | None:
    rows = query(url, "SELECT version_num FROM alembic_version")
    return rows[0]["version_num"] if rows else None


def errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if " ERROR " in line]


def test_upgrade_refuses_an_offline_migration_until_told_the_gateways_are_stopped(
    empty_database_url: str, tmp_path: Path
) -> None:
    dialect = "sqlite" if empty_database_url.startswith("sqlite") else "postgresql"
    assert kaizen(empty_database_url, tmp_path, "db", "upgrade", "0004").returncode == 0

    status = kaizen(empty_database_url, tmp_path, "db", "status")
    assert status.returncode == 0, status.stderr
    plan = json.loads(status.stdout)
    assert (plan["database"], plan["target"], plan["needs_gateways_stopped"]) == ("0004", HEAD, True)
    assert [p["revision"] for p in plan["pending"] if not p["online_safe"]] == OFFLINE[dialect]
    assert plan["pending"][0]["why"].startswith("drops `training_locks`")

    refused = kaizen(empty_database_url, tmp_path, "db", "upgrade")
    assert refused.returncode == 2, refused.stderr
    # Every pending migration is listed with its verdict, then one error line says what to do.
    listed = [
        line.split("INFO migrations.runner:   ", 1)[1]
        for line in refused.stderr.splitlines()
        if ":   " in line
    ]
    assert [line.split(" ", 1)[0] for line in listed] == [p["revision"] for p in plan["pending"]]
    assert [line.split(" ", 1)[0] for line in listed if "NOT online-safe" in line] == OFFLINE[dialect]
    [error] = errors(refused.stderr)
    assert "kaizen db upgrade does not apply what is not safe while gateways of revision 0004 serve" in error
    assert all(f"{r} " in error for r in OFFLINE[dialect])
    assert "Stop every `kaizen serve` and `kaizen worker`" in error
    assert "run `kaizen db upgrade --gateways-stopped`" in error
    assert revision(empty_database_url) == "0004"  # nothing applied, not even the online-safe ones before it

    applied = kaizen(empty_database_url, tmp_path, "db", "upgrade", "--gateways-stopped")
    assert applied.returncode == 0, applied.stderr
    assert revision(empty_database_url) == HEAD
    recorded = query(empty_database_url, "SELECT revision, previous, online_safe FROM schema_revisions")
    assert len(recorded) == len(list((REPO / "migrations" / "versions").glob("0*.py")))
    assert sorted(r["revision"] for r in recorded if not r["online_safe"]) == OFFLINE[dialect]
    previous = {r["revision"]: r["previous"] for r in recorded}
    assert (previous["0021"], previous[HEAD]) == ("0020", "0022")

    again = kaizen(empty_database_url, tmp_path, "db", "upgrade")
    assert again.returncode == 0 and f"is at revision {HEAD}: nothing to apply" in again.stderr


@pytest.mark.postgres
def test_serve_applies_online_safe_migrations_and_refuses_to_start_on_an_offline_one(
    postgres: PostgresServer, upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    online = postgres.create_database("serve_online_" + uuid.uuid4().hex[:8])
    assert kaizen(online, tmp_path, "db", "upgrade", "0019").returncode == 0
    gateway = upstream_gateway(tmp_path / "a", online, upstream.url, {"KAIZEN_LOG_LEVEL": "info"})
    try:
        asyncio.run(start(gateway))
        assert revision(online) == HEAD
    finally:
        gateway.stop()
    assert "applying 0020" in gateway.log_path.read_text()

    offline = postgres.create_database("serve_offline_" + uuid.uuid4().hex[:8])
    assert kaizen(offline, tmp_path, "db", "upgrade", "0012").returncode == 0
    output = refused_start(upstream_gateway(tmp_path / "b", offline, upstream.url))
    [error] = errors(output)
    assert (
        "kaizen serve does not apply what is not safe while gateways of revision 0012 serve: 0015 copies"
        in error
    )
    assert "run `kaizen db upgrade --gateways-stopped`, then start the gateways of this version" in error
    assert revision(offline) == "0012"


@pytest.mark.postgres
@pytest.mark.slow
def test_a_gateway_older_than_its_database_serves_only_if_every_newer_revision_was_online_safe(
    postgres: PostgresServer, upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    """A later version's `kaizen db upgrade` records the revisions it applied; this code, which does not know them,
    reads that record. Here the later revision is written the way that version's runner writes it."""
    url = postgres.create_database("newer_" + uuid.uuid4().hex[:8])
    assert kaizen(url, tmp_path, "db", "upgrade").returncode == 0
    asyncio.run(
        execute(
            url,
            "INSERT INTO schema_revisions (revision, previous, online_safe, note, recorded_at) "
            f"VALUES ('0999', '{HEAD}', true, 'creates a table nothing reads yet', now())",
            "UPDATE alembic_version SET version_num = '0999'",
        )
    )
    status = json.loads(kaizen(url, tmp_path, "db", "status").stdout)
    assert status == {"database": "0999", "code_head": HEAD, "newer_than_code": ["0999"], "serves": True}

    gateway = upstream_gateway(tmp_path / "a", url, upstream.url)
    try:
        asyncio.run(start(gateway))
        answered = asyncio.run(call(gateway))
        wait_until(
            lambda: bool(query(url, "SELECT 1 FROM calls WHERE id = :id", id=answered)), "the call stored"
        )
    finally:
        gateway.stop()
    log = gateway.log_path.read_text()
    assert (
        f"the database is at revision 0999, newer than this code ({HEAD}); every revision since (0999)" in log
    )

    asyncio.run(execute(url, "UPDATE schema_revisions SET online_safe = false, note = 'drops calls.user'"))
    [error] = errors(refused_start(upstream_gateway(tmp_path / "b", url, upstream.url)))
    assert (
        f"newer than this code ({HEAD}), and 0999 since then was not online-safe (drops calls.user)" in error
    )

    asyncio.run(execute(url, "UPDATE alembic_version SET version_num = 'f00d'"))
    refused = kaizen(url, tmp_path, "db", "upgrade")
    assert refused.returncode == 2
    [error] = errors(refused.stderr)
    assert (
        f"revision f00d, which this code (newest revision {HEAD}) does not know and which does not descend"
        in error
    )


@pytest.mark.postgres
def test_an_online_migration_gives_up_behind_a_long_transaction_instead_of_queueing_the_gateways(
    postgres: PostgresServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """0011 builds indexes on `calls`: behind a transaction that writes it, its lock request would hold every
    other statement on `calls` until that transaction ends. It waits `ONLINE_LOCK_TIMEOUT_S`, then gives up whole."""
    url = async_database_url(postgres.create_database("lock_wait_" + uuid.uuid4().hex[:8]))
    monkeypatch.setattr(runner, "ONLINE_LOCK_TIMEOUT_S", 1)

    async def scenario() -> str:
        await upgrade_database(url, "0010")
        database = Database(url)
        try:
            async with database.engine.connect() as holder:
                await holder.execute(text("LOCK TABLE calls IN ROW EXCLUSIVE MODE"))  # what an insert holds
                with pytest.raises(MigrationRefused) as refused:
                    await upgrade_database(url, "0011")
                await holder.rollback()
            await upgrade_database(url, "0011")
        finally:
            await database.dispose()
        return str(refused.value)

    message = asyncio.run(scenario())
    assert message.startswith(
        "0011 waited more than 1 s for a lock on a table that a long query or transaction"
    )
    assert "nothing was applied" in message
    assert revision(url) == "0011"


async def start(gateway: GatewayProcess) -> None:
    gateway.start()
    await gateway.wait_ready(timeout_s=120)


def refused_start(gateway: GatewayProcess) -> str:
    """Start a gateway that must refuse to serve: its exit status is 2 and its log says why."""
    gateway.start()
    assert gateway.process is not None
    try:
        status = gateway.process.wait(timeout=120)
    finally:
        gateway.stop()
    output = gateway.log_path.read_text()
    assert status == 2, output
    return output


async def call(gateway: GatewayProcess) -> str:
    raw = await sdk_chat(
        gateway, model="scripted-1", messages=[{"role": "user", "content": "served by older code"}]
    )
    assert raw.completion.choices[0].message.content == "echo: served by older code"
    return raw.headers["x-request-id"]


async def execute(url: str, *statements: str, **params: Any) -> None:
    database = Database(async_database_url(url))
    try:
        async with database.engine.begin() as connection:
            for statement in statements:
                await connection.execute(text(statement), params)
    finally:
        await database.dispose()
