"""Three `kaizen serve` processes behind an imagined load balancer: one PostgreSQL, one data directory (the
adapter store), the same keys, and one engine attached by URL. Whatever replica a request lands on:

- a conversation whose turns land on different replicas is one episode, its calls in order;
- feedback sent to any replica reaches the call, wherever it was captured;
- a promotion made through one replica is served by all within the policy refresh interval;
- each scheduled job runs once per slot of its schedule, not once per replica;
- their capture logs stay apart, so every call is stored once.

The engine is the scripted upstream (it loads and lists adapters like vLLM), because what is under test is the
gateways' shared state, not generation; `test_engine_replicas.py` serves real adapters from real vLLM replicas.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.commands.serve_process import GatewayProcess
from gateway.settings import async_database_url
from storage.database import Database
from storage.policies import activate_version, adapter_dir, add_adapter, create_policy
from tests.support.child_gateway import SdkChat, replica_set, sdk_chat
from tests.support.child_gateway import kill as child_kill
from tests.support.child_gateway import start as child_start
from tests.support.polling import wait_until_async
from tests.support.postgres import PostgresServer
from tests.support.scripted_upstream import ScriptedUpstream
from tests.support.sql import fetch_rows
from trainer.control import scheduler
from trainer.control.policy_config import ScheduleConfig
from trainer.control.ruler import JudgeSettings
from trainer.control.scheduler import JobRunner, PolicyScheduler, RunnerConfig

# Three `kaizen serve` processes, one of them killed: `make test-fast` leaves this module out.
pytestmark = pytest.mark.slow

REPLICAS = 3
REFRESH_S = 1.0
TURNS = 5


@dataclass
class Cluster:
    gateways: list[GatewayProcess]
    database_url: str
    data_dir: Path

    async def chat(self, index: int, **request: Any) -> SdkChat:
        """A chat call to replica `index % REPLICAS` through the SDK: its raw response."""
        return await sdk_chat(self.gateways[index % REPLICAS], **request)

    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.gateways[0].admin_key}"}

    async def rows(self, sql: str, **params: Any) -> list[dict[str, Any]]:
        return await fetch_rows(self.database_url, sql, **params)


async def _start_together(gateways: list[GatewayProcess]) -> None:
    for gateway in gateways:  # all at once, as an orchestrator scales them: migrations and capture race
        gateway.start()
    await asyncio.gather(*(gateway.wait_ready(timeout_s=120) for gateway in gateways))


@pytest.fixture(scope="module")
def cluster(
    postgres: PostgresServer, upstream: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    url = postgres.create_database("replicas_" + uuid.uuid4().hex[:8])
    data = tmp_path_factory.mktemp("replicas")
    gateways = replica_set(
        REPLICAS,
        data,
        url,
        upstream.url,
        {
            "KAIZEN_POLICY_REFRESH_S": str(REFRESH_S),
            "KAIZEN_SCHEDULER_REFRESH_S": "1",
            "KAIZEN_RETENTION_CRON": "",
            "KAIZEN_ADAPTER_IDLE_UNLOAD_S": "0",
            # A loaded test machine answers a lookup in tens of milliseconds (a calm one in one): wait for it, so
            # the headers of paced conversations are checked, not the machine's load.
            "KAIZEN_STITCH_LOOKUP_WAIT_MS": "3000",
        },
    )
    try:
        asyncio.run(_start_together(gateways))
        yield Cluster(gateways, url, data)
    finally:
        for gateway in gateways:
            gateway.stop()


def test_replicas_on_one_data_directory_capture_to_their_own_logs(cluster: Cluster) -> None:
    directories = set()
    for gateway in cluster.gateways:
        stats = httpx.get(gateway.url + "/admin/capture", headers=cluster.admin(), timeout=10).json()
        directories.add(stats["directory"])
    assert len(directories) == REPLICAS
    assert all(Path(d).is_relative_to(cluster.data_dir / "spool") for d in directories)


def test_a_replica_killed_beside_another_on_its_data_directory_loses_nothing(
    postgres: PostgresServer, upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    """The second replica to start must not replay (and delete) the first one's capture log: when the first is
    killed, what it answered and had not stored yet is stored when it starts again, once."""
    url = postgres.create_database("shared_dir_" + uuid.uuid4().hex[:8])
    # The first replica's writer waits ten minutes to store anything: every call it answers stays in its log.
    first, second = replica_set(
        2,
        tmp_path / "data",
        url,
        upstream.url,
        {
            "KAIZEN_CAPTURE_FLUSH_MS": "600000",
            "KAIZEN_CAPTURE_BATCH_SIZE": "100000",
            "KAIZEN_SCHEDULER": "false",
        },
    )
    second.env["KAIZEN_CAPTURE_FLUSH_MS"] = "5"

    async def calls(gateway: GatewayProcess, count: int) -> list[str]:
        ids = []
        for n in range(count):
            raw = await sdk_chat(
                gateway, model="scripted-1", messages=[{"role": "user", "content": f"kept in the log {n}"}]
            )
            ids.append(raw.headers["x-request-id"])
        return ids

    async def scenario() -> list[str]:
        await child_start(first)
        answered = await calls(first, 10)
        await child_start(second)
        answered += await calls(first, 10)
        await child_kill(first)
        await child_start(first)
        return answered

    try:
        answered = asyncio.run(scenario())
        asyncio.run(wait_until_async(lambda: _all_stored(cluster_of(url), answered), "every answered call"))
        stored = asyncio.run(fetch_rows(url, "SELECT id FROM calls"))
        assert sorted(r["id"] for r in stored) == sorted(answered)
    finally:
        first.stop()
        second.stop()


def test_a_conversation_across_replicas_is_one_episode(cluster: Cluster) -> None:
    async def stored(call_id: str) -> bool:
        return bool(await cluster.rows("SELECT 1 FROM calls WHERE id = :id", id=call_id))

    async def converse(number: int, paced: bool) -> tuple[list[str], list[str]]:
        """Turn k goes to replica number+k. Fast: the next turn is sent as soon as the reply is in (an agent
        loop; the earlier turn is usually still in the other replica's capture queue). Paced: once the earlier
        turn is stored (a person typing)."""
        kind = "paced" if paced else "fast"
        messages: list[Any] = [{"role": "user", "content": f"conversation {number} ({kind}), turn 0"}]
        calls, episodes = [], []
        for turn in range(TURNS):
            raw = await cluster.chat(number + turn, model="scripted-1", messages=messages)
            reply = raw.completion.choices[0].message
            calls.append(raw.headers["x-request-id"])
            episodes.append(raw.headers["x-episode-id"])
            messages += [reply.model_dump(exclude_none=True), {"role": "user", "content": f"turn {turn + 1}"}]
            if paced:
                await wait_until_async(lambda: stored(calls[-1]), "the turn to be stored", timeout_s=60)
        return calls, episodes

    async def scenario() -> list[tuple[bool, list[str], list[str]]]:
        fast = [converse(n, paced=False) for n in range(6)]
        paced = [converse(n, paced=True) for n in range(6, 8)]
        results = await asyncio.gather(*fast, *paced)
        return [(n >= 6, calls, episodes) for n, (calls, episodes) in enumerate(results)]

    conversations = asyncio.run(scenario())
    every_call = [c for _, calls, _ in conversations for c in calls]

    asyncio.run(
        wait_until_async(lambda: _all_stored(cluster, every_call), "every turn to be stored", timeout_s=60)
    )
    for paced, calls, headers in conversations:
        rows = asyncio.run(
            cluster.rows("SELECT id, episode_id, position FROM calls WHERE id = ANY(:ids)", ids=calls)
        )
        by_id = {r["id"]: r for r in rows}
        assert len({r["episode_id"] for r in rows}) == 1, (paced, rows)
        assert [by_id[c]["position"] for c in calls] == list(range(TURNS)), (paced, rows)
        if paced:  # the earlier turn was stored: the replica found it, and told the client
            assert set(headers) == {rows[0]["episode_id"]}, (headers, rows)
    # No episode was left behind by a turn that was first taken for a new conversation.
    empty = asyncio.run(
        cluster.rows(
            "SELECT id FROM episodes e WHERE NOT EXISTS (SELECT 1 FROM calls c WHERE c.episode_id = e.id)"
        )
    )
    assert empty == []


def test_feedback_sent_to_any_replica_reaches_the_call(cluster: Cluster) -> None:
    async def feedback(index: int, body: dict[str, Any]) -> None:
        gateway = cluster.gateways[index % REPLICAS]
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.post(
                gateway.url + "/v1/feedback",
                json=body,
                headers={"Authorization": f"Bearer {gateway.api_key}"},
            )
        assert response.status_code == 200, response.text

    async def scenario() -> dict[str, str]:
        episodes = {}
        for index in range(REPLICAS * 2):
            raw = await cluster.chat(
                index, model="scripted-1", messages=[{"role": "user", "content": f"rate me {index}"}]
            )
            call = raw.headers["x-request-id"]
            episodes[call] = raw.headers["x-episode-id"]
            # At once, to another replica: the call is still in the first one's capture queue.
            await feedback(index + 1, {"request_id": call, "value": 1.0, "name": "early"})
        await wait_until_async(lambda: _all_stored(cluster, list(episodes)), "the rated calls to be stored")
        for index, call in enumerate(episodes):  # and once stored, to the third replica
            await feedback(index + 2, {"request_id": call, "value": 0.0, "name": "late"})
        return episodes

    episodes = asyncio.run(scenario())

    async def linked() -> bool:
        rows = await cluster.rows(
            "SELECT status FROM rewards WHERE call_id = ANY(:ids) AND status = 'linked'", ids=list(episodes)
        )
        return len(rows) == 2 * len(episodes)

    asyncio.run(wait_until_async(linked, "both rewards of every call to be linked", timeout_s=60))
    rows = asyncio.run(
        cluster.rows(
            "SELECT call_id, episode_id, name FROM rewards WHERE call_id = ANY(:ids)", ids=list(episodes)
        )
    )
    assert sorted((r["call_id"], r["name"]) for r in rows) == sorted(
        (call, name) for call in episodes for name in ("early", "late")
    )
    assert all(r["episode_id"] == episodes[r["call_id"]] for r in rows)


def cluster_of(database_url: str) -> Cluster:
    """Just enough of a cluster to read its database."""
    return Cluster([], database_url, Path())


async def _all_stored(cluster: Cluster, ids: list[str]) -> bool:
    rows = await cluster.rows("SELECT count(*) AS n FROM calls WHERE id = ANY(:ids)", ids=ids)
    return int(rows[0]["n"]) == len(ids)


def test_a_promotion_through_one_replica_is_served_by_all(cluster: Cluster) -> None:
    database = Database(async_database_url(cluster.database_url))

    async def register() -> None:
        async with database.session() as session:
            policy = await create_policy(session, "bot", "scripted-1", {"schedule": {"paused": True}})
            for version in (0, 1):
                path = adapter_dir(cluster.data_dir, "bot", version)
                path.mkdir(parents=True)
                await add_adapter(session, policy.id, version, str(path), status="candidate")
            await activate_version(session, policy.id, 0)
            await session.commit()
        await database.dispose()

    async def served(index: int) -> str:
        raw = await cluster.chat(
            index, model="bot", messages=[{"role": "user", "content": "which version?"}], max_tokens=2
        )
        return raw.headers["x-kaizen-model"]

    async def serves(index: int, version: str) -> bool:
        try:
            return await served(index) == version
        except openai.NotFoundError:  # not a policy yet on this replica (until its next refresh)
            return False

    async def switch_time(index: int, since: float) -> float:
        await wait_until_async(
            functools.partial(serves, index, "bot@1"), f"replica {index} to serve bot@1", timeout_s=30
        )
        return time.monotonic() - since

    async def scenario() -> list[float]:
        await register()
        for index in range(REPLICAS):
            await wait_until_async(
                functools.partial(serves, index, "bot@0"), f"replica {index} to serve bot@0"
            )
        async with httpx.AsyncClient(timeout=30) as client:
            promoted = await client.post(
                cluster.gateways[1].url + "/admin/policies/bot/promote",
                json={"version": 1},
                headers=cluster.admin(),
            )
        assert promoted.status_code == 200, promoted.text
        since = time.monotonic()
        return list(await asyncio.gather(*(switch_time(index, since) for index in range(REPLICAS))))

    switched = asyncio.run(scenario())
    # Each replica re-reads policies every REFRESH_S and loads the new version into the engine before it
    # switches; what the bound leaves beyond that is a loaded machine's scheduling delay.
    assert max(switched) < REFRESH_S + 5, switched


def test_each_scheduled_job_runs_once_across_replicas(cluster: Cluster) -> None:
    interval = 3.0
    database = Database(async_database_url(cluster.database_url))

    async def register() -> None:
        schedule = {"judge_interval_s": interval, "train_cron": None, "retention": {"cron": None}}
        async with database.session() as session:
            await create_policy(session, "judged", "scripted-1", {"schedule": schedule})
            await session.commit()
        await database.dispose()

    async def starts() -> list[datetime]:
        rows = await cluster.rows(
            "SELECT r.started_at FROM training_runs r JOIN policies p ON p.id = r.policy_id "
            "WHERE p.name = 'judged' AND r.kind = 'judge' ORDER BY r.started_at"
        )
        return [r["started_at"] for r in rows]

    async def scenario() -> list[datetime]:
        await register()
        await wait_until_async(lambda: _at_least(starts, 5), "five judge runs", timeout_s=120)
        return await starts()

    runs = asyncio.run(scenario())
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(runs)]
    # Three schedulers fire every `interval` at their own phases; one run per slot means runs at least half an
    # interval apart (and without the slot check, about three runs per interval).
    assert min(gaps) >= interval / 2, gaps


async def _at_least(starts: Any, count: int) -> bool:
    return len(await starts()) >= count


def test_a_cron_slot_fired_by_every_replica_runs_once(
    postgres: PostgresServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replicas' schedulers fire the same cron at once or one after another (a loaded machine delays some
    by seconds, after the first run finished and freed the lock): one run either way.

    Their clock starts two seconds into a minute, as when a `* * * * *` cron has just fired. On the wall clock
    the test's firings could straddle two minutes: two slots, which rightly run twice (with the clock at 59.9 s
    into a minute the test fails that way), and that once failed it in CI."""
    url = async_database_url(postgres.create_database("cron_slot_" + uuid.uuid4().hex[:8]))
    fired = datetime.now(UTC).replace(second=2, microsecond=0)
    started = time.monotonic()
    monkeypatch.setattr(scheduler, "_now", lambda: fired + timedelta(seconds=time.monotonic() - started))

    async def scenario() -> list[Any]:
        from migrations.runner import upgrade_database

        await upgrade_database(url)
        databases = [Database(url) for _ in range(REPLICAS)]
        try:
            async with databases[0].session() as session:
                await create_policy(
                    session, "nightly", "m", {"schedule": {"retention": {"cron": "* * * * *"}}}
                )
                await session.commit()
            schedulers = [PolicyScheduler(db, JobRunner(db, _runner_config(tmp_path))) for db in databases]
            for scheduler in schedulers:  # one after another: each finds the lock free
                await scheduler.fire("nightly", "retention", "cron")
            await asyncio.gather(*(s.fire("nightly", "retention", "cron") for s in schedulers))  # and at once
            return await fetch_rows(url, "SELECT kind, status FROM training_runs")
        finally:
            for db in databases:
                await db.dispose()

    assert asyncio.run(scenario()) == [{"kind": "retention", "status": "succeeded"}]
    assert ScheduleConfig().retention.cron is not None  # the default schedule has a retention cron to dedupe


def _runner_config(tmp_path: Path) -> RunnerConfig:
    return RunnerConfig(
        data_dir=tmp_path,
        judge=JudgeSettings(model=""),
        database_url="",  # trains nothing
        train_command=[],
        gate_url="http://127.0.0.1:9/v1",
    )
