"""`kaizen backup` while a real `kaizen serve` answers calls, `kaizen restore` into a fresh data directory and
database, and a gateway started there: it serves the same active version from the restored adapter files, holds
every call answered before the backup once (those that were only in the capture log at backup time included,
those in both the log and the database not doubled), and the rewards as they were. On SQLite and PostgreSQL.

The engine is a scripted upstream attached as vLLM (it loads and lists adapters by path, like vLLM), a fresh one
for each gateway, so the restored gateway can only serve a version whose files the restore put in its own store.
The refusals (a damaged backup, a non-empty or busy target, a newer schema, no `pg_dump`) run the command in this
process.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.capture.directory import CaptureDirectory
from gateway.commands.main import main as kaizen_main
from gateway.commands.serve_process import GatewayProcess
from gateway.settings import async_database_url
from migrations.runner import known_revisions, upgrade_database
from storage.database import Database
from storage.policies import activate_version, adapter_dir, add_adapter, create_policy
from tests.support.child_gateway import replica_set, sdk_chat
from tests.support.child_gateway import start as start_gateway
from tests.support.polling import poll, wait_until_async
from tests.support.postgres import PostgresServer
from tests.support.scripted_upstream import ScriptedUpstream
from tests.support.sql import fetch_rows

BATCH = 5  # the source gateway's capture batch: with an endless flush window only full batches are stored
ACTIVE = 1  # the version `bot` serves: neither its first nor its newest


@dataclass
class Place:
    """A data directory and the database beside it: where a gateway runs, or where a backup is restored."""

    data_dir: Path
    database_url: str

    @property
    def env(self) -> dict[str, str]:
        return {"KAIZEN_DATA_DIR": str(self.data_dir), "KAIZEN_DATABASE_URL": self.database_url}

    async def rows(self, sql: str, **params: Any) -> list[dict[str, Any]]:
        return await fetch_rows(self.database_url, sql, **params)


@pytest.fixture(
    params=["sqlite", pytest.param("postgres", marks=[pytest.mark.postgres, pytest.mark.postgres_twin])]
)
def places(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Place, Place]:
    """The source installation and an empty target, of one database kind."""
    if request.param == "sqlite":
        return (
            Place(tmp_path / "source", f"sqlite:///{tmp_path / 'source' / 'kaizen.db'}"),
            Place(tmp_path / "restored", f"sqlite:///{tmp_path / 'restored' / 'kaizen.db'}"),
        )
    server: PostgresServer = request.getfixturevalue("postgres")
    return (
        Place(tmp_path / "source", server.create_database("source_" + uuid.uuid4().hex[:8])),
        Place(tmp_path / "restored", server.create_database("restored_" + uuid.uuid4().hex[:8])),
    )


@pytest.fixture
def engines() -> Iterator[tuple[ScriptedUpstream, ScriptedUpstream]]:
    with ScriptedUpstream() as source, ScriptedUpstream() as restored:
        yield source, restored


async def register_policy(place: Place) -> None:
    """Policy `bot` with versions 0, 1 and 2 in the adapter store, version 1 active."""
    url = async_database_url(place.database_url)
    await upgrade_database(url)
    database = Database(url)
    try:
        async with database.session() as session:
            policy = await create_policy(session, "bot", "scripted-1", {"schedule": {"paused": True}})
            for version in (0, 1, 2):
                path = adapter_dir(place.data_dir, "bot", version)
                path.mkdir(parents=True)
                (path / "adapter_config.json").write_text(json.dumps({"r": 8, "version": version}))
                (path / "adapter_model.safetensors").write_bytes(os.urandom(4096 + version))
                await add_adapter(session, policy.id, version, str(path))
            await activate_version(session, policy.id, ACTIVE)
            await session.commit()
    finally:
        await database.dispose()


def gateway_at(
    place: Place, engine: ScriptedUpstream, extra_env: dict[str, str] | None = None
) -> GatewayProcess:
    (gateway,) = replica_set(
        1,
        place.data_dir,
        place.database_url,
        engine.url,
        {"KAIZEN_SCHEDULER": "false", "KAIZEN_LOG_LEVEL": "info", **(extra_env or {})},
    )
    return gateway


@dataclass
class Traffic:
    """Calls to `bot` and rewards for them, as a client keeps them."""

    gateway: GatewayProcess
    answered: dict[str, str] = field(default_factory=dict)  # x-request-id -> the call's text
    rewards: dict[str, tuple[str, float]] = field(default_factory=dict)  # idempotency key -> (call, value)

    async def call(self, text: str) -> str:
        raw = await sdk_chat(
            self.gateway, model="bot", messages=[{"role": "user", "content": text}], max_tokens=4
        )
        assert raw.headers["x-kaizen-model"] == f"bot@{ACTIVE}"
        self.answered[raw.headers["x-request-id"]] = text
        return raw.headers["x-request-id"]

    async def reward(self, request_id: str, value: float) -> str:
        key = f"reward-{request_id}"
        async with httpx.AsyncClient(timeout=30) as http:
            sent = await http.post(
                self.gateway.url + "/v1/feedback",
                json={"request_id": request_id, "value": value, "idempotency_key": key},
                headers={"Authorization": f"Bearer {self.gateway.api_key}"},
            )
        assert sent.status_code == 200, sent.text
        self.rewards[key] = (request_id, value)
        return key


async def serves(gateway: GatewayProcess, version: str) -> bool:
    async with httpx.AsyncClient(timeout=30) as http:
        answer = await http.post(
            gateway.url + "/v1/chat/completions",
            json={"model": "bot", "messages": [{"role": "user", "content": "probe"}], "max_tokens": 2},
            headers={"Authorization": f"Bearer {gateway.api_key}", "X-Kaizen-No-Log": "true"},
        )
    return answer.status_code == 200 and answer.headers["x-kaizen-model"] == version


def logged_ids(*log_dirs: Path) -> set[str]:
    """The call ids in capture log segments (a line being appended right now is skipped)."""
    ids = set()
    for directory in log_dirs:
        for segment in sorted(directory.glob("*.jsonl")):
            for line in segment.read_bytes().splitlines():
                try:
                    ids.add(json.loads(line)["id"])
                except ValueError:
                    continue
    return ids


async def stored_ids(place: Place) -> set[str]:
    return {row["id"] for row in await place.rows("SELECT id FROM calls")}


async def kaizen(place: Place, *args: str) -> dict[str, Any]:
    """`kaizen ARGS` in a process of its own on `place`; its one line of JSON on stdout."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway",
        *args,
        env={**os.environ, **place.env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    return dict(json.loads(out))


async def capture_stats(gateway: GatewayProcess) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=30) as http:
        answer = await http.get(
            gateway.url + "/admin/capture", headers={"Authorization": f"Bearer {gateway.admin_key}"}
        )
    return dict(answer.json())


async def check_restored(
    target: Place,
    engine: ScriptedUpstream,
    before_backup: set[str],
    traffic: Traffic,
    backup_log: set[str],
    snapshot: set[str],
    rewarded_before: set[str],
) -> None:
    """A gateway on the restored place serves `bot@1` from its own store, holds every call answered before the
    backup once and the rewards sent before it (`rewarded_before`, idempotency keys) as they were sent, and
    stored from the log exactly the calls the snapshot lacked."""
    restored = gateway_at(target, engine)
    try:
        await start_gateway(restored)
        await wait_until_async(
            lambda: serves(restored, f"bot@{ACTIVE}"), "the restored gateway to serve bot@1"
        )
        async with httpx.AsyncClient(timeout=30) as http:
            listed = (await http.get(engine.url + "/models")).json()["data"]
        roots = {card["id"]: card.get("root") for card in listed}
        assert roots[f"bot@{ACTIVE}"] == str(adapter_dir(target.data_dir, "bot", ACTIVE).resolve())

        async def replayed() -> bool:
            return before_backup <= await stored_ids(target)

        assert await poll(replayed, 30), before_backup - await stored_ids(target)
        stats = await capture_stats(restored)
        assert stats["dropped"] == 0, stats
        # The calls of the backed-up log that the snapshot lacked were stored, and no other: those in both
        # were recognised as stored.
        assert stats["recovered"] == len(backup_log - snapshot), (stats, len(backup_log), len(snapshot))

        rows = await target.rows("SELECT id, episode_id, position, adapter_version FROM calls")
        assert {row["id"] for row in rows} <= set(traffic.answered)
        assert {row["adapter_version"] for row in rows} == {ACTIVE}
        assert not [n for n in Counter((r["episode_id"], r["position"]) for r in rows).values() if n > 1]
        texts = Counter(traffic.answered[row["id"]] for row in rows)
        assert not {text: n for text, n in texts.items() if n > 1}

        async def linked() -> bool:
            rewards = await target.rows("SELECT status FROM rewards")
            return all(row["status"] == "linked" for row in rewards)

        assert await poll(linked, 30), await target.rows("SELECT * FROM rewards")
        rewards = await target.rows("SELECT idempotency_key, call_id, value FROM rewards")
        restored_rewards = {r["idempotency_key"]: (r["call_id"], r["value"]) for r in rewards}
        assert rewarded_before <= set(restored_rewards)
        assert restored_rewards.items() <= traffic.rewards.items()

        versions = await target.rows(
            "SELECT a.version, a.status, a.path, p.active_version FROM adapters a JOIN policies p ON p.id = a.policy_id"
        )
        assert sorted(row["version"] for row in versions) == [0, 1, 2]
        assert {row["active_version"] for row in versions} == {ACTIVE}
        for row in versions:
            path = Path(row["path"])
            assert path == adapter_dir(target.data_dir, "bot", row["version"]).resolve()
            assert (path / "adapter_model.safetensors").stat().st_size == 4096 + row["version"]
    finally:
        restored.stop()


@pytest.mark.slow
def test_a_backup_taken_while_serving_restores_every_call_once(
    places: tuple[Place, Place], engines: tuple[ScriptedUpstream, ScriptedUpstream], tmp_path: Path
) -> None:
    """The capture log at backup time holds calls the database already stored and calls it has not: the source
    stores only whole batches of BATCH and its flush window never ends, so the log keeps both."""
    source, target = places
    backup = tmp_path / "backup"

    async def scenario() -> None:
        await register_policy(source)
        gateway = gateway_at(
            source,
            engines[0],
            {"KAIZEN_CAPTURE_BATCH_SIZE": str(BATCH), "KAIZEN_CAPTURE_FLUSH_MS": "600000"},
        )
        traffic = Traffic(gateway)
        try:
            await start_gateway(gateway)
            await wait_until_async(lambda: serves(gateway, f"bot@{ACTIVE}"), "the gateway to serve bot@1")
            log_dir = source.data_dir / "spool" / "log"
            # Calls (each rewarded) until the log holds stored calls and exactly one that is not: the writer
            # deletes a segment only after a batch, so nothing changes until BATCH more calls are answered.
            for n in range(12 * BATCH):
                request_id = await traffic.call(f"call {n}")
                await traffic.reward(request_id, n / 10)
                full = len(traffic.answered) // BATCH * BATCH
                assert await poll(functools.partial(_count_is, source, full), 30), f"{full} calls stored"
                logged, stored = logged_ids(log_dir), await stored_ids(source)
                if n >= 2 * BATCH and len(traffic.answered) % BATCH == 1 and logged & stored:
                    break
            else:
                pytest.fail("the capture log never held a stored and an unstored call at once")
            before_backup = set(traffic.answered)
            assert logged - stored and logged & stored

            # The backup runs while the gateway answers more calls (too few to complete a batch).
            summary, *_ = await asyncio.gather(
                kaizen(source, "backup", str(backup)),
                *(traffic.call(f"during {n}") for n in range(BATCH - 2)),
            )
            snapshot = await stored_ids(source)  # nothing was stored since the backup's log copy
            assert snapshot == stored
        finally:
            gateway.stop()
        backup_log = logged_ids(backup / "capture")
        assert logged <= backup_log  # the calls only in the log, and some stored ones as well
        assert summary["capture_calls"] == len(backup_log)
        assert summary["active_versions"] == {"bot": ACTIVE}
        manifest = json.loads((backup / "manifest.json").read_text())
        assert manifest["schema_revision"] == known_revisions()[0]
        assert sorted(f["path"] for f in manifest["files"] if f["path"].startswith("adapters/")) == [
            f"adapters/bot/{v}/{name}"
            for v in (0, 1, 2)
            for name in ("adapter_config.json", "adapter_model.safetensors")
        ]

        shutil.rmtree(source.data_dir)  # nothing of the source installation is needed any more
        report = await kaizen(target, "restore", str(backup))
        assert report["active_versions"] == {"bot": ACTIVE}
        assert report["capture_calls"] == len(backup_log)
        await check_restored(
            target, engines[1], before_backup, traffic, backup_log, snapshot, set(traffic.rewards)
        )
        # Over the installation it restored (which stored the log since): --force puts the snapshot back.
        await kaizen(target, "restore", str(backup), "--force")
        assert await stored_ids(target) == snapshot
        assert logged_ids(target.data_dir / "spool" / "log") == backup_log

    asyncio.run(scenario())


async def _count_is(place: Place, count: int) -> bool:
    return len(await stored_ids(place)) == count


@pytest.mark.slow
def test_a_backup_under_load_holds_every_call_answered_before_it(
    places: tuple[Place, Place], engines: tuple[ScriptedUpstream, ScriptedUpstream], tmp_path: Path
) -> None:
    """Calls keep coming while the backup runs, and the writer keeps committing them (SQLite's online backup and
    pg_dump's snapshot beside its writes): every call answered before the backup started is restored, once."""
    source, target = places
    backup = tmp_path / "backup"

    async def scenario() -> None:
        await register_policy(source)
        gateway = gateway_at(source, engines[0])
        traffic = Traffic(gateway)
        backing_up = asyncio.Event()
        done = asyncio.Event()
        before_backup: set[str] = set()
        rewarded_before: set[str] = set()

        async def client(index: int) -> None:
            n = 0
            while not done.is_set():
                request_id = await traffic.call(f"client {index} call {n}")
                if not backing_up.is_set():
                    before_backup.add(request_id)
                    if n % 3 == 0:
                        key = await traffic.reward(request_id, n / 10)
                        if not backing_up.is_set():
                            rewarded_before.add(key)
                n += 1

        try:
            await start_gateway(gateway)
            await wait_until_async(lambda: serves(gateway, f"bot@{ACTIVE}"), "the gateway to serve bot@1")
            clients = [asyncio.create_task(client(index)) for index in range(4)]
            await wait_until_async(lambda: _at_least(traffic, 40), "40 answered calls")
            backing_up.set()
            await kaizen(source, "backup", str(backup))
            done.set()
            await asyncio.gather(*clients)
        finally:
            gateway.stop()
        assert len(traffic.answered) > len(before_backup)  # calls were answered while it ran
        backup_log = logged_ids(backup / "capture")
        shutil.rmtree(source.data_dir)
        await kaizen(target, "restore", str(backup))
        snapshot = await stored_ids(target)  # the restored database before a gateway stores the log
        await check_restored(
            target, engines[1], before_backup, traffic, backup_log, snapshot, rewarded_before
        )

    asyncio.run(scenario())


async def _at_least(traffic: Traffic, count: int) -> bool:
    return len(traffic.answered) >= count


# ---------------------------------------------------------------------------------------------- refusals
def run_kaizen(place: Place, *args: str) -> int:
    """`kaizen ARGS` in this process, on `place`."""
    return kaizen_main([*args, "--data-dir", str(place.data_dir), "--database-url", place.database_url])


def sqlite_place(root: Path) -> Place:
    return Place(root, f"sqlite:///{root / 'kaizen.db'}")


def test_restore_checks_the_backup_and_the_target_before_writing_anything(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = sqlite_place(tmp_path / "source")
    asyncio.run(register_policy(source))
    backup = tmp_path / "backup"
    assert run_kaizen(source, "backup", str(backup)) == 0
    assert run_kaizen(source, "backup", str(backup)) == 2  # never into a backup that is there
    assert "exists and is not empty" in caplog.text

    def refused(backup_dir: Path, expected: str) -> None:
        target = sqlite_place(tmp_path / f"target-{uuid.uuid4().hex[:6]}")
        caplog.clear()
        assert run_kaizen(target, "restore", str(backup_dir)) == 2
        assert expected in caplog.text, caplog.text
        assert not target.data_dir.exists() or not any(target.data_dir.iterdir())

    damaged = tmp_path / "damaged"
    shutil.copytree(backup, damaged)
    weights = damaged / "adapters" / "bot" / "1" / "adapter_model.safetensors"
    weights.write_bytes(bytes([weights.read_bytes()[0] ^ 1]) + weights.read_bytes()[1:])
    refused(damaged, "adapters/bot/1/adapter_model.safetensors does not match its SHA-256")
    (damaged / "adapters" / "bot" / "1" / "adapter_config.json").unlink()
    refused(damaged, "the backup is incomplete: adapters/bot/1/adapter_config.json is missing")

    future = tmp_path / "future"
    shutil.copytree(backup, future)
    manifest = json.loads((future / "manifest.json").read_text())
    (future / "manifest.json").write_text(json.dumps({**manifest, "schema_revision": "9999"}))
    refused(future, "schema revision 9999 is newer than this Kaizen knows")
    refused(tmp_path / "source", "is not a Kaizen backup")

    target = sqlite_place(tmp_path / "target")
    assert run_kaizen(target, "restore", str(backup)) == 0
    caplog.clear()
    assert run_kaizen(target, "restore", str(backup)) == 2
    assert "the target is not empty" in caplog.text and "--force" in caplog.text
    claimed = CaptureDirectory.claim(target.data_dir / "spool")  # as a gateway serving there holds it
    try:
        caplog.clear()
        assert run_kaizen(target, "restore", str(backup), "--force") == 2
        assert "a gateway is running on" in caplog.text
    finally:
        claimed.release()
    assert run_kaizen(target, "restore", str(backup), "--force") == 0


def test_a_backup_of_an_older_schema_is_restored_and_upgraded(tmp_path: Path) -> None:
    older = known_revisions()[1]
    source = sqlite_place(tmp_path / "source")
    asyncio.run(upgrade_database(async_database_url(source.database_url), older))
    backup = tmp_path / "backup"
    assert run_kaizen(source, "backup", str(backup)) == 0
    assert json.loads((backup / "manifest.json").read_text())["schema_revision"] == older
    target = sqlite_place(tmp_path / "target")
    assert run_kaizen(target, "restore", str(backup)) == 0
    rows = asyncio.run(target.rows("SELECT version_num FROM alembic_version"))
    assert rows == [{"version_num": known_revisions()[0]}]


def test_a_postgresql_backup_without_pg_dump_says_what_is_missing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    place = Place(tmp_path / "data", "postgresql://kaizen@127.0.0.1:1/kaizen")
    empty = tmp_path / "no-binaries"
    empty.mkdir()
    assert run_kaizen(place, "backup", str(tmp_path / "backup"), "--pg-bin-dir", str(empty)) == 2
    assert f"pg_dump not found in {empty} (KAIZEN_PG_BIN_DIR)" in caplog.text
    assert not (tmp_path / "backup").exists()
