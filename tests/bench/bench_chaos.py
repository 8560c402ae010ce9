"""The whole loop under randomised faults: demo traffic, feedback and scheduled training on PostgreSQL with two
gateway replicas, while a driver kills its parts at random times, then counts what survived.

The set-up is a small production one on one machine:

* a throwaway PostgreSQL cluster; one data directory (the adapter store) shared by both replicas;
* replica A, `kaizen serve` that starts and supervises vLLM on a fixed port; replica B, `kaizen serve` attached
  to that vLLM by URL (`KAIZEN_VLLM_URL`); both run the schedule, the policy lock keeps their jobs apart;
* a round-robin TCP balancer in front of both (a connection refused by one replica goes to the other), which
  the simulated app (`gateway.demo.traffic`, the `openai` SDK, signed feedback) calls, as `kaizen demo` does;
* a supervisor that starts a replica again 2 s after it exits, as systemd's `Restart=always` would.

The driver waits `--first-fault-s`, then, every 90-180 s (`--gap-s`, seeded), injects the next fault of a shuffled rotation:

* `gateway`: SIGKILL replica A or B (killing A takes vLLM down with it until A is back);
* `writer`: SIGKILL a replica's capture writer child;
* `vllm`: SIGKILL vLLM's API server (A's watchdog restarts it; B loads its adapters again on a 404);
* `training`: SIGKILL the training child of the run under way (waits up to 90 s for one);
* `postgres`: stop PostgreSQL (`pg_ctl -m fast`) for 10-30 s.

At the end the traffic stops, both replicas get SIGTERM, and the report counts: calls answered (the app got a
reply) against calls stored, each once; rewards the gateway accepted against rewards stored, each once;
training runs by outcome; versions promoted; runs left `running` and job locks left held after a clean stop;
processes of the run still alive after it (found by an environment marker every child inherits); and the live
reward of the first and last cycles.

    python -m tests.bench.bench_chaos [--minutes 30] [--seed 0] [--out tests/bench/results/chaos.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import re
import secrets
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from gateway.commands.serve_process import GatewayProcess
from gateway.demo.report import summarise
from gateway.demo.runner import POLICY, DemoOptions, policy_config, split_cores, wait_for_model
from gateway.demo.tasks import TASKS
from gateway.demo.traffic import CallResult, SimulatedApp
from tests.support.ports import free_port
from tests.support.postgres import PostgresServer, find_bin_dir
from tests.support.tcp_balancer import TcpBalancer

logger = logging.getLogger("bench_chaos")

ROOT = Path(__file__).resolve().parents[2]
FAULTS = ("gateway", "writer", "vllm", "training", "postgres")
#: The app's calls as stored: live traffic, not the training run's own sampling through the gateway.
TRAFFIC_CALLS = (
    "SELECT c.id, c.status FROM calls c JOIN episodes e ON e.id = c.episode_id WHERE e.source = 'traffic'"
)
#: Every process of the run inherits this variable: what is left of the run after it is found by it.
MARKER = "KAIZEN_BENCH_CHAOS_RUN"


@dataclass
class Fault:
    kind: str
    at_s: float
    target: str = ""
    detail: str = ""


@dataclass
class Replica:
    name: str
    process: GatewayProcess
    restarts: int = 0
    stopping: bool = False


@dataclass
class Run:
    """Everything the driver, the supervisor and the app share."""

    started: float = field(default_factory=time.monotonic)
    faults: list[Fault] = field(default_factory=list)
    results: list[CallResult] = field(default_factory=list)

    def now(self) -> float:
        return round(time.monotonic() - self.started, 1)


class ChaosApp(SimulatedApp):
    """The demo's app, with feedback retried long enough to outlast a database restart (30 s)."""

    feedback_attempts = 10


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return list(psutil.Process(pid).children(recursive=True))
    except psutil.NoSuchProcess:
        return []


def _find(replicas: list[Replica], needle: str) -> list[tuple[Replica, psutil.Process]]:
    """The replicas' descendants whose command line contains `needle` as whole words."""
    pattern = re.compile(rf"(^|\s){re.escape(needle)}(\s|$)")
    found = []
    for replica in replicas:
        process = replica.process.process
        if process is None or process.poll() is not None:
            continue
        for child in _descendants(process.pid):
            with contextlib.suppress(psutil.Error):
                if pattern.search(" ".join(child.cmdline())):
                    found.append((replica, child))
    return found


async def supervise(replicas: list[Replica], run: Run) -> None:
    """Start a replica that exited again after 2 s (it was killed, or could not start while the database was
    down)."""
    while True:
        for replica in replicas:
            process = replica.process.process
            if replica.stopping or process is None or process.poll() is None:
                continue
            logger.info(
                "%s: replica %s exited (%s); starting it again", run.now(), replica.name, process.returncode
            )
            await asyncio.sleep(2)
            replica.restarts += 1
            replica.process.start()
        await asyncio.sleep(0.5)


async def inject(
    kind: str, replicas: list[Replica], pg: PostgresServer, rng: random.Random, run: Run
) -> Fault:
    fault = Fault(kind, run.now())
    if kind == "gateway":
        replica = rng.choice(replicas)
        process = replica.process.process
        assert process is not None
        fault.target = replica.name
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
        else:
            fault.detail = "already down"
    elif kind in ("writer", "vllm", "training"):
        needle = {
            "writer": "gateway.capture.writer",
            "vllm": "vllm.entrypoints.openai.api_server",
            "training": "trainer.learner",  # the training child, not a model job (`trainer.learner.<job>`)
        }[kind]
        deadline = time.monotonic() + (90 if kind == "training" else 30)
        while not (found := _find(replicas, needle)) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(1)
        if not found:
            fault.detail = "none running"
        else:
            replica, victim = rng.choice(found)
            fault.target = f"{replica.name} pid {victim.pid}"
            fault.at_s = run.now()
            with contextlib.suppress(psutil.Error):
                victim.send_signal(signal.SIGKILL)
    elif kind == "postgres":
        down_s = rng.uniform(10, 30)
        fault.detail = f"down {down_s:.0f} s"
        await asyncio.to_thread(pg.stop)
        await asyncio.sleep(down_s)
        await asyncio.to_thread(pg.start)
    logger.info("%s: fault %s %s %s", run.now(), kind, fault.target, fault.detail)
    return fault


async def drive(
    replicas: list[Replica],
    pg: PostgresServer,
    rng: random.Random,
    run: Run,
    first_s: float,
    gap_s: tuple[float, float],
    until_s: float,
) -> None:
    await asyncio.sleep(first_s)
    rotation: list[str] = []
    while run.now() < until_s:
        if not rotation:
            rotation = list(FAULTS)
            rng.shuffle(rotation)
        run.faults.append(await inject(rotation.pop(), replicas, pg, rng, run))
        await asyncio.sleep(rng.uniform(*gap_s))


async def traffic(app: ChaosApp, run: Run, until_s: float, cycle_calls: int) -> list[dict[str, Any]]:
    cycles: list[dict[str, Any]] = []
    while run.now() < until_s:
        results = await app.cycle(cycle_calls)
        run.results.extend(results)
        cycle = summarise(len(cycles) + 1, results)
        cycles.append(asdict(cycle))
        logger.info(
            "%s: cycle %d served by v%s, mean reward %.3f, %d errors",
            run.now(),
            cycle.cycle,
            cycle.version,
            cycle.mean_reward,
            cycle.errors,
        )
    return cycles


async def wait_stored(database_url: str, answered: set[str], timeout_s: float = 180) -> None:
    """Until every answered call is stored, or the count stops growing for 30 s (then the report says what is
    missing)."""
    deadline = time.monotonic() + timeout_s
    last, still_since = -1, time.monotonic()
    while time.monotonic() < deadline:
        stored = {row[0] for row in (await _query(database_url, TRAFFIC_CALLS))["rows"]}
        count = len(answered & stored)
        if count == len(answered):
            return
        if count != last:
            last, still_since = count, time.monotonic()
        elif time.monotonic() - still_since > 30:
            return
        await asyncio.sleep(2)


async def _query(database_url: str, sql: str) -> dict[str, Any]:
    import asyncpg

    connection = await asyncpg.connect(database_url)
    try:
        rows = await connection.fetch(sql)
    finally:
        await connection.close()
    return {"rows": [tuple(row.values()) for row in rows]}


async def account(database_url: str, run: Run) -> dict[str, Any]:
    """Answered against stored, rewards accepted against stored, and what the training runs did."""
    answered = {r.call_id for r in run.results if r.call_id}
    rows = (await _query(database_url, TRAFFIC_CALLS))["rows"]
    stored = Counter(row[0] for row in rows)
    errors = {row[0] for row in rows if row[1] != "ok"}
    accepted = {f"demo:{r.call_id}" for r in run.results if r.rewarded}
    reward_rows = (
        await _query(
            database_url, "SELECT idempotency_key, call_id FROM rewards WHERE idempotency_key LIKE 'demo:%'"
        )
    )["rows"]
    rewards = Counter(row[0] for row in reward_rows)
    per_call = Counter(row[1] for row in reward_rows)
    runs = (
        await _query(
            database_url, "SELECT id, status, error, to_version FROM training_runs WHERE kind = 'train'"
        )
    )["rows"]
    adapters = (
        await _query(
            database_url,
            "SELECT a.version, a.status FROM adapters a JOIN policies p ON p.id = a.policy_id "
            f"WHERE p.name = '{POLICY}' ORDER BY a.version",
        )
    )["rows"]
    statuses = Counter(row[1] for row in runs)
    return {
        "calls": {
            "answered": len(answered),
            "failed_at_the_client": sum(1 for r in run.results if r.error),
            "stored": len(stored),
            "answered_and_stored": len(answered & set(stored)),
            "answered_not_stored": sorted(answered - set(stored)),
            "stored_twice": sorted(k for k, n in stored.items() if n > 1),
            "answered_but_stored_as_failed": sorted(answered & errors),
            # Attempts that failed (503 while the engine restarted, retried by the SDK): recorded as failed calls.
            "failed_attempts_stored": len(errors),
            # Answered by a gateway, yet the client never got the reply (the connection broke on the way back).
            "stored_ok_not_received": len(set(stored) - answered - errors),
        },
        "rewards": {
            "accepted": len(accepted),
            "stored": len(rewards),
            "accepted_not_stored": sorted(accepted - set(rewards)),
            "stored_twice": sorted(k for k, n in rewards.items() if n > 1),
            "calls_with_two_user_rewards": sorted(str(k) for k, n in per_call.items() if n > 1),
        },
        "training_runs": {
            "started": len(runs),
            "by_status": dict(statuses),
            "errors": [str(row[2])[:200] for row in runs if row[1] == "failed"],
            "succeeded_after_a_failure": any(
                row[1] == "succeeded" and any(f[1] == "failed" and f[0] < row[0] for f in runs)
                for row in runs
            ),
        },
        "versions": {
            "created": len(adapters),
            "promoted": sum(1 for row in adapters if row[0] > 0 and row[1] in ("active", "retired")),
            "by_status": dict(Counter(row[1] for row in adapters)),
        },
    }


async def leftovers(database_url: str, token: str) -> dict[str, Any]:
    """After both replicas stopped cleanly: runs still `running`, locks still held, and live processes."""
    running = (await _query(database_url, "SELECT id FROM training_runs WHERE status = 'running'"))["rows"]
    locks = (await _query(database_url, "SELECT key, owner, job FROM job_locks"))["rows"]
    alive = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if process.environ().get(MARKER) == token and process.status() != psutil.STATUS_ZOMBIE:
                alive.append({"pid": process.pid, "cmdline": " ".join(process.info["cmdline"] or [])[:200]})
    return {
        "runs_left_running": [row[0] for row in running],
        "locks_left_held": [list(row) for row in locks],
        "processes_left": alive,
    }


def replica_env(pg_url: str, secret: str, token: str, extra: dict[str, str]) -> dict[str, str]:
    return {
        "KAIZEN_DATABASE_URL": pg_url,
        "KAIZEN_FEEDBACK_SECRET": secret,
        "KAIZEN_SCHEDULER": "true",
        "KAIZEN_SCHEDULER_REFRESH_S": "2",
        "KAIZEN_WORKERS": "1",
        MARKER: token,
        **extra,
    }


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from gateway.base_models import resolve_base_model
    from gateway.settings import Settings

    settings = Settings()
    work = Path(tempfile.mkdtemp(prefix="kaizen-bench-chaos-"))
    logger.info("work directory (logs, data): %s", work)
    rng = random.Random(args.seed)
    token = secrets.token_hex(8)
    secret = secrets.token_hex(16)
    base_path = await asyncio.to_thread(resolve_base_model, settings.base_model, settings.data_dir / "models")
    bin_dir = find_bin_dir()
    if bin_dir is None:
        raise SystemExit("PostgreSQL's server binaries are not installed (apt-get install postgresql)")
    pg = PostgresServer(
        bin_dir
    )  # a directory of its own: the server runs as `postgres`, which cannot enter `work`
    pg.init()
    pg.start()
    pg.wait_ready()
    pg_url = pg.create_database("kaizen")
    data = work / "data"
    vllm_port = free_port()
    a = GatewayProcess(
        data,
        base_path,
        work / "replica-a.log",
        replica_env(pg_url, secret, token, {"KAIZEN_VLLM_PORT": str(vllm_port)}),
    )
    b = GatewayProcess(
        data,
        base_path,
        work / "replica-b.log",
        replica_env(
            pg_url,
            secret,
            token,
            {
                "KAIZEN_VLLM_URL": f"http://127.0.0.1:{vllm_port}/v1",
                "KAIZEN_API_KEYS": a.api_key,
                "KAIZEN_ADMIN_KEY": a.admin_key,
            },
        ),
    )
    b.api_key, b.admin_key = a.api_key, a.admin_key
    for gateway in (a, b):
        gateway.env[MARKER] = token
        split_cores(gateway.env, os.cpu_count() or 1)
    replicas = [Replica("A", a), Replica("B", b)]
    result: dict[str, Any] = {
        "command": " ".join(["python -m tests.bench.bench_chaos", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "load_average_at_start": [round(v, 2) for v in os.getloadavg()]},
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "minutes": args.minutes,
        "seed": args.seed,
        "task": args.task,
    }
    balancer = TcpBalancer(failover=True)
    for name, gateway in (("A", a), ("B", b)):
        balancer.add(name, int(gateway.url.rsplit(":", 1)[1]))
    await balancer.start()
    url = balancer.url
    app: ChaosApp | None = None
    background: list[asyncio.Task[Any]] = []
    try:
        a.start()
        await a.wait_ready()
        b.start()
        await b.wait_ready()
        options = DemoOptions(
            None, data, settings.data_dir / "models", settings.base_model, task=args.task, seed=args.seed
        )
        await a.create_policy(POLICY, policy_config(options))
        await wait_for_model(url, a.api_key, POLICY)
        logger.info("policy %r created; %.0f minutes of traffic and faults start", POLICY, args.minutes)
        task = TASKS[args.task]
        app = ChaosApp(
            f"{url}/v1",
            a.api_key,
            secret,
            task.questions(),
            model=POLICY,
            rate=options.rate,
            concurrency=options.concurrency,
            max_tokens=options.reply_tokens,
            seed=args.seed,
        )
        run = Run()
        until = args.minutes * 60
        background = [
            asyncio.create_task(supervise(replicas, run)),
            asyncio.create_task(
                drive(replicas, pg, rng, run, args.first_fault_s, tuple(args.gap_s), until - 60)
            ),
        ]
        cycles = await traffic(app, run, until, options.cycle_calls)
        result["cycles"] = cycles
        for job in background:
            job.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        background = []
        for replica in replicas:  # one the driver killed last may still be starting
            if replica.process.process is not None and replica.process.process.poll() is not None:
                replica.process.start()
            await replica.process.wait_ready()
        answered = {r.call_id for r in run.results if r.call_id}
        await wait_stored(pg_url, answered)
        result["faults"] = [asdict(f) for f in run.faults]
        result["replica_restarts"] = {r.name: r.restarts for r in replicas}
        result["accounting"] = await account(pg_url, run)
    finally:
        for job in background:
            job.cancel()
        if app is not None:
            await app.close()
        for replica in replicas:
            replica.stopping = True
        await asyncio.gather(*(asyncio.to_thread(r.process.stop) for r in replicas))
        await balancer.close()
    result["after_clean_stop"] = await leftovers(pg_url, token)
    cycles = result.get("cycles", [])
    first, last = cycles[:3], cycles[-3:]
    result["live_reward"] = {
        "first_cycles": round(sum(c["mean_reward"] for c in first) / max(len(first), 1), 4),
        "last_cycles": round(sum(c["mean_reward"] for c in last) / max(len(last), 1), 4),
    }
    pg.destroy()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    logger.info("wrote %s", args.out)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--task", default="opposites")
    parser.add_argument("--first-fault-s", type=float, default=180.0, help="Traffic before the first fault.")
    parser.add_argument(
        "--gap-s",
        type=float,
        nargs=2,
        default=[90.0, 180.0],
        metavar=("MIN", "MAX"),
        help="Seconds between faults.",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "tests/bench/results/chaos.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for chatty in ("httpx", "httpx2", "openai"):
        logging.getLogger(chatty).setLevel(logging.WARNING)
    asyncio.run(benchmark(args))


if __name__ == "__main__":
    main()
