"""The scheduler on SQLite and PostgreSQL: one job per policy across OS processes, one coalesced catch-up
run after downtime, and retention that never touches the active, pinned or rollback versions."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from sqlalchemy import update

from gateway.settings import Settings, async_database_url
from migrations.runner import upgrade_database
from storage.database import Database
from storage.jobs import list_runs
from storage.locks import acquire_lock
from storage.models import Adapter, Call, Episode, TrainingRun
from storage.policies import (
    activate_version,
    adapter_dir,
    add_adapter,
    create_policy,
    get_policy,
    list_adapters,
)
from tests.conftest import query
from tests.support.polling import wait_until_async
from tests.support.training_children import RECORDS_ITS_RUN
from trainer.control.ruler import JudgeSettings
from trainer.control.scheduler import JobRunner, PolicyScheduler, RunnerConfig

REPO = Path(__file__).resolve().parents[2]


def runner(database: Database, data_dir: Path) -> JobRunner:
    config = RunnerConfig(
        data_dir=data_dir,
        judge=JudgeSettings(model=""),
        database_url=database.url,
        train_command=[sys.executable, "-m", "trainer.learner"],
        gate_url="http://127.0.0.1:9/v1",
    )
    return JobRunner(database, config)


class CountingScheduler(PolicyScheduler):
    """Counts completed re-reads of the policies, so a test can wait for N of them instead of sleeping."""

    syncs = 0

    async def sync(self) -> None:
        await super().sync()
        self.syncs += 1

    async def wait_for_syncs(self, count: int) -> None:
        async def done() -> bool:
            return self.syncs >= count

        await wait_until_async(done, f"{count} scheduler refreshes")


async def fresh_database(url: str) -> Database:
    url = async_database_url(url)
    await upgrade_database(url)
    return Database(url)


@pytest.mark.slow
def test_two_processes_racing_for_one_policy_run_it_once(
    database_url: str, tmp_path: Path, embedded_model: Path
) -> None:
    async def setup() -> None:
        database = await fresh_database(database_url)
        try:
            async with database.session() as session:
                await create_policy(session, "race", str(embedded_model), {})
                await session.commit()
        finally:
            await database.dispose()

    asyncio.run(setup())
    argv = [
        sys.executable,
        "-m",
        "gateway",
        "worker",
        "--once",
        "train",
        "--policy",
        "race",
        "--database-url",
        database_url,
        "--data-dir",
        str(tmp_path / "data"),
    ]
    workers = [
        subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outcomes = []
    for worker in workers:
        out, err = worker.communicate(timeout=120)
        outcomes.append((worker.returncode, json.loads(out.strip().splitlines()[-1]), err))
    statuses = sorted(line["status"] for _, line, _ in outcomes)
    assert statuses == ["busy", "skipped"], outcomes  # skipped: the winner's run found no rewarded data
    assert sorted(rc for rc, _, _ in outcomes) == [0, 75]

    async def runs() -> list[Any]:
        database = Database(async_database_url(database_url))
        try:
            async with database.session() as session:
                return await list_runs(session, "race")
        finally:
            await database.dispose()

    [run] = asyncio.run(runs())
    assert run.kind == "train" and run.status == "skipped" and run.config["trigger"] == "worker"


def test_missed_runs_after_downtime_are_coalesced_into_one(database_url: str, tmp_path: Path) -> None:
    interval = 60.0
    schedule = {"judge_interval_s": interval, "train_cron": None, "retention": {"cron": None}}

    async def scenario() -> tuple[dict[str, int], dict[str, datetime | None]]:
        database = await fresh_database(database_url)
        now = datetime.now(UTC)
        try:
            async with database.session() as session:
                for name, last in (("stale", now - timedelta(seconds=3.5 * interval)), ("fresh", now)):
                    policy = await create_policy(session, name, "base", {"schedule": schedule})
                    session.add(
                        TrainingRun(
                            policy_id=policy.id, kind="judge", status="succeeded", started_at=last, config={}
                        )
                    )
                await session.commit()

            async def judge_runs(name: str) -> int:
                async with database.session() as session:
                    return len(await list_runs(session, name, "judge"))

            async def judge_runs_at_least(name: str, count: int) -> bool:
                return await judge_runs(name) >= count

            scheduler = CountingScheduler(database, runner(database, tmp_path), refresh_s=0.5)
            await scheduler.start()
            try:
                # The catch-up run, however slow the machine.
                await wait_until_async(
                    lambda: judge_runs_at_least("stale", 2), "the stale policy to catch up", 60
                )
                # Six more refreshes of the policies: a second catch-up would have happened by now.
                await scheduler.wait_for_syncs(scheduler.syncs + 6)
                next_runs = dict(scheduler.jobs())
            finally:
                await scheduler.stop()
            counts = {name: await judge_runs(name) for name in ("stale", "fresh")}
            return counts, next_runs
        finally:
            await database.dispose()

    counts, next_runs = asyncio.run(scenario())
    assert counts == {"stale": 2, "fresh": 1}  # the stale policy caught up exactly once; the fresh one waits
    stale_next, fresh_next = next_runs["stale:judge"], next_runs["fresh:judge"]
    assert stale_next is not None and fresh_next is not None
    in_a_minute = datetime.now(UTC) + timedelta(seconds=interval)
    assert abs((stale_next - in_a_minute).total_seconds()) < 10  # back on its regular interval
    assert abs((fresh_next - in_a_minute).total_seconds()) < 10


def test_paused_schedule_runs_nothing(database_url: str, tmp_path: Path) -> None:
    schedule = {"paused": True, "judge_interval_s": 60, "train_cron": "* * * * *"}

    async def scenario() -> tuple[int, list[Any]]:
        database = await fresh_database(database_url)
        try:
            async with database.session() as session:
                policy = await create_policy(session, "paused", "base", {"schedule": schedule})
                old = datetime.now(UTC) - timedelta(hours=2)
                session.add(
                    TrainingRun(policy_id=policy.id, kind="judge", status="succeeded", started_at=old)
                )
                await session.commit()
            scheduler = CountingScheduler(database, runner(database, tmp_path), refresh_s=0.5)
            await scheduler.start()
            try:
                await scheduler.wait_for_syncs(
                    3
                )  # three reads of the paused config: nothing may be scheduled
                jobs = scheduler.jobs()
            finally:
                await scheduler.stop()
            async with database.session() as session:
                return len(await list_runs(session, "paused")), jobs
        finally:
            await database.dispose()

    runs, jobs = asyncio.run(scenario())
    assert runs == 1 and jobs == []


class EngineRecorder(BaseHTTPRequestHandler):
    """A scripted vLLM sleep API: answers 200 and records each request, in order, on its server."""

    def _record(self) -> None:
        self.server.requests.append(f"{self.command} {self.path}")  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    do_GET = do_POST = _record

    def log_message(self, *_: Any) -> None:
        pass


def test_engine_sleeps_draining_calls_for_training_and_wakes_even_when_it_fails(
    database_url: str, tmp_path: Path
) -> None:
    """One GPU shared by serving and training: the engine is put to sleep in `wait` mode (calls in flight
    finish, new ones queue) before the training child starts, and woken after it, here after a failed child."""
    engine = ThreadingHTTPServer(("127.0.0.1", 0), EngineRecorder)
    engine.requests = []  # type: ignore[attr-defined]
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    root = f"http://127.0.0.1:{engine.server_port}"
    # The child tells the engine it runs (so the order is recorded in one place), then fails.
    child = "import sys, urllib.request; urllib.request.urlopen(sys.argv[1]).read(); sys.exit(3)"

    async def scenario() -> str | None:
        database = await fresh_database(database_url)
        try:
            async with database.session() as session:
                await create_policy(session, "shared-gpu", "base", {})
                await session.commit()
            config = RunnerConfig(
                data_dir=tmp_path,
                judge=JudgeSettings(model=""),
                database_url=database.url,
                train_command=[sys.executable, "-c", child, f"{root}/child"],
                gate_url="http://127.0.0.1:9/v1",
                engine_url=f"{root}/v1",
                sleep_engine=True,
            )
            info = await JobRunner(database, config).run("shared-gpu", "train")
            return info.status if info is not None else None
        finally:
            await database.dispose()

    try:
        status = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert status == "failed"
    assert engine.requests == [  # type: ignore[attr-defined]
        "POST /sleep?level=1&mode=wait",
        "GET /child",
        "POST /wake_up",
    ]


def test_the_training_child_gets_the_gpus_and_threads_it_is_given(tmp_path: Path) -> None:
    """Training apart from the engine: the child's CUDA_VISIBLE_DEVICES is `train_gpus` and its OMP_NUM_THREADS
    `train_threads`, whatever this process's are; without them, the child inherits ours."""
    seen = tmp_path / "seen"
    child = (
        "import os, sys; open(sys.argv[1], 'w').write("
        "os.environ.get('CUDA_VISIBLE_DEVICES', '-') + ' ' + os.environ.get('OMP_NUM_THREADS', '-')); sys.exit(3)"
    )

    async def scenario(train_gpus: str, train_threads: int) -> str | None:
        database = await fresh_database(f"sqlite:///{tmp_path / 'kaizen.db'}")
        try:
            async with database.session() as session:
                if await get_policy(session, "own-gpu") is None:
                    await create_policy(session, "own-gpu", "base", {})
                    await session.commit()
            config = dataclasses.replace(
                runner(database, tmp_path).config,
                train_command=[sys.executable, "-c", child, str(seen)],
                train_gpus=train_gpus,
                train_threads=train_threads,
            )
            info = await JobRunner(database, config).run("own-gpu", "train")
            return info.status if info is not None else None
        finally:
            await database.dispose()

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDA_VISIBLE_DEVICES", "0")
        patch.setenv("OMP_NUM_THREADS", "8")
        assert asyncio.run(scenario("1,2", 1)) == "failed"
        assert seen.read_text() == "1,2 1"
        assert asyncio.run(scenario("", 0)) == "failed"
        assert seen.read_text() == "0 8"


# A training child that records its run as the trainer does, tells the engine it runs, then trains "forever".
LONG_CHILD = (
    RECORDS_ITS_RUN
    + """
import os, subprocess, time, urllib.request

asyncio.run(record())
urllib.request.urlopen(sys.argv[3]).read()
# A process that does not stop on SIGTERM (a trainer stuck in a collective): only a SIGKILL to the group ends it.
rank = subprocess.Popen(
    [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"]
)
open(sys.argv[4], "w").write(f"{os.getpid()} {rank.pid}")
time.sleep(600)
"""
)


def test_stopping_the_scheduler_mid_training_kills_the_child_records_the_run_and_wakes_the_engine(
    database_url: str, tmp_path: Path, caplog: Any
) -> None:
    """A gateway shut down while its scheduled training runs: the scheduler's stop ends the job itself, before
    the engine and the database go (the child killed, its run marked failed, the engine woken), and nothing is
    logged as an error: the run is interrupted, not broken."""
    engine = ThreadingHTTPServer(("127.0.0.1", 0), EngineRecorder)
    engine.requests = []  # type: ignore[attr-defined]
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    root = f"http://127.0.0.1:{engine.server_port}"
    pid_file = tmp_path / "child.pid"
    schedule = {"train_cron": "0 3 * * *"}  # last ran two days ago: a catch-up run starts at once
    url = async_database_url(database_url)

    async def scenario() -> tuple[str, str | None, float]:
        database = await fresh_database(database_url)
        try:
            async with database.session() as session:
                policy = await create_policy(session, "nightly", "base", {"schedule": schedule})
                session.add(
                    TrainingRun(
                        policy_id=policy.id,
                        kind="train",
                        status="succeeded",
                        started_at=datetime.now(UTC) - timedelta(days=2),
                        config={},
                    )
                )
                await session.commit()
            config = RunnerConfig(
                data_dir=tmp_path,
                judge=JudgeSettings(model=""),
                train_command=[
                    sys.executable,
                    "-c",
                    LONG_CHILD,
                    url,
                    str(policy.id),
                    f"{root}/child",
                    str(pid_file),
                ],
                database_url=database.url,
                gate_url="http://127.0.0.1:9/v1",
                engine_url=f"{root}/v1",
                sleep_engine=True,
                stop_grace_s=1.0,
            )
            scheduler = PolicyScheduler(database, JobRunner(database, config), refresh_s=0.5)
            await scheduler.start()

            async def child_started() -> bool:
                return pid_file.exists()

            try:
                await wait_until_async(child_started, "the training child to start", 60)
            finally:
                started = time.monotonic()
                await scheduler.stop()
                stop_s = time.monotonic() - started
            async with database.session() as session:
                runs = await list_runs(session, "nightly", "train")
            latest = max(runs, key=lambda run: run.id)
            return latest.status, latest.error, stop_s
        finally:
            await database.dispose()

    caplog.set_level(logging.INFO)
    try:
        status, error, stop_s = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert (status, error) == ("failed", "interrupted: the scheduler shut down")
    assert stop_s < 15, stop_s  # stop waited for the job to end, not for the child's 600 s
    child, rank = (int(pid) for pid in pid_file.read_text().split())
    with pytest.raises(ProcessLookupError):  # killed and reaped before stop returned
        os.kill(child, 0)
    # The rank went with its group (it is not this process's child: nothing here reaps it, so it may linger
    # as a zombie until its reaper does).
    assert not psutil.pid_exists(rank) or psutil.Process(rank).status() == psutil.STATUS_ZOMBIE
    assert engine.requests == [  # type: ignore[attr-defined]
        "POST /sleep?level=1&mode=wait",
        "GET /child",
        "POST /wake_up",
    ]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]
    assert any(
        "interrupted" in r.getMessage() for r in caplog.records if r.name == "trainer.control.scheduler"
    )


def test_a_job_firing_while_its_last_run_goes_on_is_not_a_warning(tmp_path: Path, caplog: Any) -> None:
    """A training run started by the threshold check outlasts many checks; APScheduler's "skipped: maximum
    number of running instances" for each of them is the design (one instance per job), logged at DEBUG."""
    from apscheduler.events import EVENT_JOB_MAX_INSTANCES

    async def scenario() -> int:
        database = await fresh_database(f"sqlite:///{tmp_path / 'kaizen.db'}")
        scheduler = PolicyScheduler(database, runner(database, tmp_path), refresh_s=30)
        skipped = 0

        def count(_: Any) -> None:
            nonlocal skipped
            skipped += 1

        async def slow() -> None:  # a run longer than its interval, like a training run under its check
            await asyncio.sleep(2)

        try:
            await scheduler.start()
            scheduler._scheduler.add_listener(count, EVENT_JOB_MAX_INSTANCES)
            scheduler._scheduler.add_job(
                slow, "interval", seconds=0.2, id="slow", next_run_time=datetime.now(UTC)
            )

            async def skipped_twice() -> bool:
                return skipped >= 2

            await wait_until_async(skipped_twice, "two skipped firings")
        finally:
            await scheduler.stop()
            await database.dispose()
        return skipped

    caplog.set_level(logging.DEBUG, logger="apscheduler.scheduler")
    assert asyncio.run(scenario()) >= 2
    overlaps = [r for r in caplog.records if "maximum number of running instances" in r.getMessage()]
    assert overlaps and {r.levelno for r in overlaps} == {logging.DEBUG}

    caplog.clear()
    caplog.set_level(logging.INFO, logger="apscheduler.scheduler")
    asyncio.run(scenario())
    assert not [r for r in caplog.records if "maximum number of running instances" in r.getMessage()]


def test_retention_never_touches_active_pinned_or_rollback_versions(
    database_url: str, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    now = datetime.now(UTC)
    schedule = {"retention": {"calls_days": 30, "keep_versions": 2}}

    async def scenario() -> tuple[Any, list[Any], list[str]]:
        database = await fresh_database(database_url)
        try:
            async with database.session() as session:
                policy = await create_policy(session, "keep", "base", {"schedule": schedule})
                for version in range(7):
                    path = adapter_dir(data_dir, "keep", version)
                    path.mkdir(parents=True)
                    (path / "adapter_model.safetensors").write_bytes(b"x")
                    await add_adapter(session, policy.id, version, str(path), status="candidate")
                await activate_version(session, policy.id, 0)
                await activate_version(session, policy.id, 2)  # 0 is the rollback target now
                await activate_version(session, policy.id, 3)  # 2 is the rollback target now
                await session.execute(
                    update(Adapter)
                    .where(Adapter.policy_id == policy.id, Adapter.version == 1)
                    .values(pinned=True)
                )
                for age_days, episode in ((40, "old"), (1, "new")):
                    created = now - timedelta(days=age_days)
                    session.add(Episode(id=episode, policy="keep", created_at=created, updated_at=created))
                    await session.flush()
                    session.add(
                        Call(
                            id=f"call-{episode}",
                            episode_id=episode,
                            position=0,
                            policy="keep",
                            model="keep",
                            request={"messages": [{"role": "user", "content": "hi"}]},
                            latency_ms=1.0,
                            status="ok",
                            created_at=created,
                        )
                    )
                await session.commit()
            run = await runner(database, data_dir).run("keep", "retention")
            async with database.session() as session:
                adapters = await list_adapters(session, policy.id)
                calls = [c.id for c in (await session.execute(Call.__table__.select())).all()]
            return run, adapters, calls
        finally:
            await database.dispose()

    run, adapters, calls = asyncio.run(scenario())
    assert run is not None and run.status == "succeeded", run
    kept = {a.version: a.status for a in adapters}
    # active 3, pinned 1, rollback target 2, newest two 5 and 6; 0 and 4 go
    assert kept == {1: "candidate", 2: "retired", 3: "active", 5: "candidate", 6: "candidate"}
    assert sorted(run.metrics["versions"]) == [0, 4]
    for version in range(7):
        assert adapter_dir(data_dir, "keep", version).exists() == (version in kept)
    assert calls == ["call-new"] and run.metrics["calls"] == 1 and run.metrics["episodes"] == 1


def test_worker_settings_reach_the_training_child(tmp_path: Path) -> None:
    from gateway.scheduling import gate_url, runner_config
    from trainer.control.scheduler import TrainOptions
    from trainer.control.training_job import decode_job

    settings = Settings.load(
        data_dir=tmp_path,
        api_keys="k1,k2",
        host="0.0.0.0",
        port=8123,
        scheduler=False,
        judge_model="judge-m",
        judge_api_key="judge-secret",
        feedback_secret="hook-secret",
    )
    config = runner_config(settings)
    assert gate_url(settings) == "http://127.0.0.1:8123/v1"
    # The child is the trainer's own entry point, with nothing in argv: everything, secrets included, is its job.
    assert config.train_command == [sys.executable, "-m", "trainer.learner"]
    since = datetime(2026, 3, 1, 12, 30, tzinfo=UTC)
    options = TrainOptions({"mode": "warm_start", "tags": ["a b", "c=d"]}, since, "cpu")
    job = decode_job(config.training_job("p", "/models/base", options, lock_owner="host:1:abc").encode())
    assert (job.policy, job.data_dir, job.database_url, job.base_model) == (
        "p",
        str(tmp_path.resolve()),
        settings.database_url,
        "/models/base",
    )
    assert (job.judge.model, job.judge.api_key, job.webhook_secret) == (
        "judge-m",
        "judge-secret",
        "hook-secret",
    )
    assert (job.engine_url, job.engine_api_key, job.engine_max_n) == (
        gate_url(settings),
        "k1",
        settings.max_n,
    )
    assert (job.overrides, job.since, job.device) == (
        {"mode": "warm_start", "tags": ["a b", "c=d"]},
        since,
        "cpu",
    )
    assert job.lock_owner == "host:1:abc"
    asleep = runner_config(settings.model_copy(update={"engine_sleep_during_training": True}))
    assert asleep.training_job("p", "b", TrainOptions()).engine_url is None  # a sleeping engine cannot answer
    # Elsewhere than beside vLLM on this CPU the child sees the GPUs and cores this process sees; beside it, the
    # threads `training_threads` picks (tests/unit/test_settings.py).
    threads = settings.training_threads()
    environment = config.train_environment()
    if threads == 0:
        assert environment is None
    else:
        assert environment is not None and environment["OMP_NUM_THREADS"] == str(threads)
    upstream = runner_config(settings.model_copy(update={"engine": "upstream"}))
    assert upstream.train_environment() is None
    apart = runner_config(settings.model_copy(update={"train_gpus": "1"})).train_environment()
    assert apart is not None and apart["CUDA_VISIBLE_DEVICES"] == "1"
    several = runner_config(settings.model_copy(update={"train_processes": 2}))
    assert several.train_command[1:3] == ["-m", "trainer.learner.torchrun"]
    assert several.train_command[-2:] == ["-m", "trainer.learner"]


def test_admin_api_triggers_lists_and_pauses(make_gateway: Callable[..., Any], database_url: str) -> None:
    gw = make_gateway(database_url, admin_key="admin-key", scheduler=True, scheduler_refresh_s=0.5)
    admin = {"Authorization": "Bearer admin-key"}

    async def setup() -> None:
        database = Database(async_database_url(database_url))
        try:
            async with database.session() as session:
                await create_policy(session, "ops", "base", {"schedule": {"train_cron": None}})
                await session.commit()
                # another process is running a job of "busy"
                await create_policy(session, "busy", "base", {})
                await session.commit()
                assert await acquire_lock(session, "busy", "elsewhere", "train", ttl_s=60)
        finally:
            await database.dispose()

    asyncio.run(setup())
    started = httpx.post(gw.url + "/admin/policies/ops/judge", headers=admin, timeout=30)
    assert started.status_code == 202, started.text
    run_id = started.json()["run_id"]
    deadline = time.monotonic() + 20
    while True:
        [run] = [
            r for r in httpx.get(gw.url + "/admin/runs?policy=ops", headers=admin).json() if r["id"] == run_id
        ]
        if run["status"] != "running" or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert run["kind"] == "judge" and run["status"] == "succeeded" and run["config"]["trigger"] == "manual"
    assert run["metrics"]["groups"] == 0
    assert httpx.get(f"{gw.url}/admin/runs/{run_id}", headers=admin).json()["id"] == run_id

    busy = httpx.post(gw.url + "/admin/policies/busy/train", headers=admin, timeout=30)
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "job_running"
    assert httpx.post(gw.url + "/admin/policies/nope/judge", headers=admin).status_code == 404
    assert httpx.post(gw.url + "/admin/policies/ops/judge").status_code == 401

    paused = httpx.post(gw.url + "/admin/policies/ops/pause", headers=admin)
    assert paused.status_code == 200 and paused.json()["schedule"]["paused"] is True
    [row] = query(database_url, "SELECT config FROM policies WHERE name = 'ops'")
    config = json.loads(row["config"]) if isinstance(row["config"], str) else row["config"]
    assert config["schedule"] == {"train_cron": None, "paused": True}
    scheduler = gw.services.jobs.scheduler
    assert scheduler is not None and not [j for j, _ in scheduler.jobs() if j.startswith("ops:")]
    resumed = httpx.post(gw.url + "/admin/policies/ops/resume", headers=admin)
    assert resumed.json()["schedule"]["paused"] is False
    assert "ops:judge" in {j for j, _ in scheduler.jobs()}


def test_a_run_left_running_by_a_dead_process_is_failed_by_the_next_job(
    database_url: str, tmp_path: Path
) -> None:
    """A gateway SIGKILLed mid-training leaves its run `running` and its lock held: once the lock has expired,
    the policy's next job marks the run failed (as abandoned) before it starts, so nothing shows it training for
    ever; a run of another policy is not touched."""

    async def scenario() -> tuple[TrainingRun, TrainingRun, Any]:
        database = await fresh_database(database_url)
        try:
            async with database.session() as session:
                policy = await create_policy(session, "orphaned", "base", {})
                other = await create_policy(session, "other", "base", {})
                left = TrainingRun(policy_id=policy.id, status="running", config={})
                elsewhere = TrainingRun(policy_id=other.id, status="running", config={})
                session.add_all([left, elsewhere])
                await session.commit()
                # The dead holder's lock, already expired.
                assert await acquire_lock(session, "orphaned", "dead-host:1:x", "train", ttl_s=-1)
            run = await runner(database, tmp_path).run("orphaned", "retention")
            async with database.session() as session:
                return (
                    await session.get_one(TrainingRun, left.id),
                    await session.get_one(TrainingRun, elsewhere.id),
                    run,
                )
        finally:
            await database.dispose()

    left, elsewhere, run = asyncio.run(scenario())
    assert run is not None and run.status == "succeeded"
    assert left.status == "failed" and left.finished_at is not None
    assert left.error is not None and left.error.startswith("abandoned:")
    assert elsewhere.status == "running"


ORPHANED_PARENT = """
import asyncio, sys
from pathlib import Path
from storage.database import Database
from trainer.control.ruler import JudgeSettings
from trainer.control.scheduler import JobRunner, RunnerConfig

CHILD = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)"


async def main() -> None:
    database = Database(sys.argv[1])
    config = RunnerConfig(
        data_dir=Path(sys.argv[2]),
        judge=JudgeSettings(model=""),
        database_url=database.url,
        train_command=[sys.executable, "-c", CHILD, sys.argv[3]],
        gate_url="http://127.0.0.1:9/v1",
    )
    await JobRunner(database, config).run("orphan", "train")


asyncio.run(main())
"""


def _ignore_sighup() -> None:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def test_a_sigkilled_gateway_takes_its_training_child_with_it(database_url: str, tmp_path: Path) -> None:
    """The training child has a session of its own (so that stopping it reaches torchrun's ranks), which a
    SIGKILL to its gateway does not reach: it asks Linux for a signal when its parent dies, even where the gateway
    runs under `nohup`. An orphan would go on training under the job lock it inherited, and no run of the policy
    could start until it ended."""

    async def setup() -> None:
        database = await fresh_database(database_url)
        try:
            async with database.session() as session:
                await create_policy(session, "orphan", "base", {})
                await session.commit()
        finally:
            await database.dispose()

    asyncio.run(setup())
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            ORPHANED_PARENT,
            async_database_url(database_url),
            str(tmp_path),
            str(pid_file),
        ],
        cwd=REPO,
        # As `nohup kaizen serve` runs it: SIGHUP ignored, which a child inherits through exec unless it is reset.
        preexec_fn=_ignore_sighup,  # noqa: PLW1509 (no threads in the child yet)
    )
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert parent.poll() is None, "the job ended before its child started"
            assert time.monotonic() < deadline, "the training child never started"
            time.sleep(0.05)
        child = int(pid_file.read_text())
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the training child outlived its SIGKILLed parent"
            time.sleep(0.05)
    finally:
        if parent.poll() is None:
            parent.kill()
        if pid_file.exists() and pid_file.read_text() and psutil.pid_exists(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
