"""Captured calls per second into one PostgreSQL, with one and with three gateway replicas, and where the
database becomes the limit.

One run, side by side: the scripted upstream alone (`direct`: what the load generator and upstream reach without
a gateway), then `--replicas` values of `kaizen serve` children on one throwaway PostgreSQL and one data directory,
taking the calls in turn as a round-robin load balancer would, and finally the capture writer's own ceiling
(`writer`: `write_calls` batches of synthetic calls straight into PostgreSQL from 1 and 3 writers, no HTTP). For
each gateway target it reports calls served per second, calls captured per second (rows in `calls` from the first
to the last, drain included), the backlog, and the CPU time each part spent per captured call: the gateways, the
PostgreSQL server (every backend, also the exited ones) and, by difference, the rest of the machine. CPU time per
call does not depend on how loaded the machine is, so it says how many calls a core of each part can carry:
PostgreSQL becomes the limit when the gateways' replicas together send it more than its cores can take.

    python -m tests.bench.bench_replicas [--seconds 20] [--concurrency 32] [--replicas 1 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from gateway.commands.serve_process import GatewayProcess
from gateway.settings import async_database_url
from migrations.runner import upgrade_database
from storage.database import Database
from tests.bench.bench_overhead import Processes, Target, wait_healthy
from tests.bench.bench_sustained import Run, load, row_count
from tests.bench.bench_writer import make_record
from tests.support.child_gateway import replica_set
from tests.support.ports import free_port
from tests.support.postgres import PostgresServer, find_bin_dir
from tests.support.sql import fetch_rows

logger = logging.getLogger("bench_replicas")

DEFAULT_OUT = Path(__file__).parent / "results" / "replicas.json"
REQUEST_TIMEOUT_S = 30.0
DRAIN_TIMEOUT_S = 120.0
SAMPLE_S = 0.5
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int, children: bool = False) -> float:
    """User + system CPU of a process (and of its exited, waited-for children) from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime
    if children:
        ticks += int(fields[13]) + int(fields[14])  # cutime, cstime
    return ticks / CLOCK_TICKS


def postgres_cpu_seconds(data_dir: Path) -> float:
    """CPU of a PostgreSQL server: the postmaster with every backend it reaped, plus its live children."""
    postmaster = int((data_dir / "postmaster.pid").read_text().split()[0])
    total = cpu_seconds(postmaster, children=True)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent == postmaster:
                total += cpu_seconds(int(entry.name))
        except (OSError, ValueError):
            continue  # exited meanwhile: the postmaster's children time has it once reaped
    return total


def machine_cpu_seconds() -> float:
    """CPU time of the whole machine (every core, busy time only) from /proc/stat."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]
    )
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS


async def commits(database_url: str) -> int:
    """Transactions committed in the database so far (PostgreSQL's statistics; the capture writer commits one
    per batch)."""
    [row] = await fetch_rows(
        database_url, "SELECT xact_commit AS n FROM pg_stat_database WHERE datname = current_database()"
    )
    return int(row["n"])


async def through_replicas(
    session: aiohttp.ClientSession,
    gateways: list[GatewayProcess],
    upstream_pid: int,
    database_url: str,
    pg_data: Path,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Load spread over the replicas; captured calls per second from the first to the last row."""
    headers = {"Authorization": f"Bearer {gateways[0].api_key}"}
    urls = [f"{g.url}/v1/chat/completions" for g in gateways]
    warm = await load(session, urls, headers, args.warmup_seconds, args.concurrency)
    rows_before = await row_count(database_url)
    while rows_before < warm.served:  # the warm-up's calls are stored before the clock starts
        await asyncio.sleep(0.05)
        rows_before = await row_count(database_url)
    commits_before = await commits(database_url)

    def cpu_now() -> tuple[float, float, float, float]:
        return (
            sum(cpu_seconds(g.process.pid) for g in gateways if g.process),
            postgres_cpu_seconds(pg_data),
            cpu_seconds(upstream_pid) + cpu_seconds(os.getpid()),
            machine_cpu_seconds(),
        )

    cpu_before = cpu_now()
    run = Run()
    backlog: list[int] = []
    started = time.perf_counter()
    running = asyncio.create_task(load(session, urls, headers, args.seconds, args.concurrency, run))
    while not running.done():
        await asyncio.wait({running}, timeout=SAMPLE_S)
        backlog.append(max(0, warm.served + run.served - await row_count(database_url)))
    await running
    served = warm.served + run.served
    rows = await row_count(database_url)
    while rows < served and time.perf_counter() - started < args.seconds + DRAIN_TIMEOUT_S:
        await asyncio.sleep(0.05)
        rows = await row_count(database_url)
    stored_s = time.perf_counter() - started
    gateway_cpu, postgres_cpu, load_cpu, machine_cpu = (
        after - before for after, before in zip(cpu_now(), cpu_before, strict=True)
    )
    # The sampler's own queries commit too; at two a second they are a small share.
    batches = await commits(database_url) - commits_before
    captured = rows - rows_before
    per_call_ms = {
        "gateways": gateway_cpu * 1000 / captured,
        "postgres": postgres_cpu * 1000 / captured,
        "upstream_and_load_generator": load_cpu * 1000 / captured,
    }
    return {
        **run.summary(),
        "replicas": len(gateways),
        "captured": captured,
        "captured_per_s": round(captured / stored_s, 1),
        "store_s": round(stored_s, 2),
        "missing_after_drain": served - rows,
        "backlog_max": max(backlog, default=0),
        "calls_per_commit": round(captured / max(batches, 1), 1),
        "cpu_ms_per_captured_call": {k: round(v, 3) for k, v in per_call_ms.items()},
        # Everything else the machine ran meanwhile (other users of a shared machine), for the record.
        "other_cpu_s": round(machine_cpu - gateway_cpu - postgres_cpu - load_cpu, 1),
        # What one core of each part carries at that cost per call.
        "calls_per_s_per_core": {k: round(1000 / v) for k, v in per_call_ms.items() if v > 0},
    }


async def writer_ceiling(database_url: str, pg_data: Path, writers: int, records: int) -> dict[str, Any]:
    """`writers` capture writers storing batches of 500 synthetic calls as fast as PostgreSQL takes them."""
    from storage.calls import write_calls

    url = async_database_url(database_url)
    await upgrade_database(url)
    databases = [Database(url) for _ in range(writers)]

    async def writer(db: Database) -> None:
        for start in range(0, records // writers, 500):
            batch = [make_record(start + n) for n in range(500)]
            async with db.session() as session:
                await write_calls(session, batch)

    try:
        cpu_before = postgres_cpu_seconds(pg_data)
        started = time.perf_counter()
        await asyncio.gather(*(writer(db) for db in databases))
        elapsed = time.perf_counter() - started
        postgres_cpu = postgres_cpu_seconds(pg_data) - cpu_before
    finally:
        for db in databases:
            await db.dispose()
    stored = (records // writers // 500) * 500 * writers
    return {
        "writers": writers,
        "calls": stored,
        "calls_per_s": round(stored / elapsed, 1),
        "postgres_cpu_ms_per_call": round(postgres_cpu * 1000 / stored, 3),
    }


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    bin_dir = find_bin_dir()
    if bin_dir is None:
        raise RuntimeError("PostgreSQL server binaries not found (install Debian's postgresql package)")
    with tempfile.TemporaryDirectory(prefix="kaizen-replicas-") as tmp:
        root = Path(tmp)
        processes = Processes(root)
        port = free_port()
        upstream_url = f"http://127.0.0.1:{port}/v1"
        upstream = Target("upstream", f"{upstream_url}/chat/completions", f"http://127.0.0.1:{port}/health")
        server = PostgresServer(bin_dir)
        server.init()
        server.start()
        try:
            server.wait_ready()
            process = processes.start(
                "upstream", [sys.executable, "-m", "tests.support.scripted_upstream", "--port", str(port)]
            )
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
            timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
                await wait_healthy(session, upstream, process, processes)
                await load(session, upstream.chat_url, {}, args.warmup_seconds, args.concurrency)
                results["direct"] = (
                    await load(session, upstream.chat_url, {}, args.seconds, args.concurrency)
                ).summary()
                logger.info("direct: %s", results["direct"])
                for count in args.replicas:
                    url = server.create_database(f"replicas{count}")
                    gateways = replica_set(
                        count,
                        root / f"data{count}",
                        url,
                        upstream_url,
                        {
                            "KAIZEN_ENGINE": "upstream",
                            "KAIZEN_UPSTREAM_URL": upstream_url,
                            "KAIZEN_UPSTREAM_TOKEN_IDS": "true",
                            "KAIZEN_SCHEDULER": "false",
                            "KAIZEN_LOG_LEVEL": "warning",
                        },
                    )
                    try:
                        for gateway in gateways:
                            gateway.start()
                        await asyncio.gather(*(g.wait_ready(timeout_s=120) for g in gateways))
                        logger.info("%d replica(s) for %.0f s", count, args.seconds)
                        name = f"replicas_{count}"
                        results[name] = await through_replicas(
                            session, gateways, process.pid, url, server.data, args
                        )
                        logger.info("%s: %s", name, results[name])
                    finally:
                        for gateway in gateways:
                            gateway.stop()
            for writers in args.writers:
                url = server.create_database(f"writer{writers}")
                name = f"writer_{writers}"
                results[name] = await writer_ceiling(url, server.data, writers, args.writer_calls)
                logger.info("%s: %s", name, results[name])
        finally:
            processes.stop_all()
            server.destroy()
    return {
        "benchmark": "captured calls per second with gateway replicas on one PostgreSQL",
        "settings": {key: value for key, value in vars(args).items() if key != "out"},
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average_at_end": [round(v, 2) for v in os.getloadavg()],
        },
        "unix_time": int(time.time()),
        "results": results,
    }


def format_table(results: dict[str, Any]) -> str:
    lines = [
        f"{'target':<12} {'served/s':>9} {'captured/s':>10} {'p50 ms':>7} {'p99 ms':>7} {'errors':>6} "
        f"{'missing':>7} {'per commit':>10} | CPU ms per captured call: gateways / postgres / upstream+client"
    ]
    for name, r in results.items():
        if name.startswith("writer"):
            lines.append(
                f"{name:<12} {'':>9} {r['calls_per_s']:>10} {'':>7} {'':>7} {'':>6} {'':>7} {500:>10} |"
                f" postgres {r['postgres_cpu_ms_per_call']}"
            )
            continue
        row = f"{name:<12} {r['req_per_s']:>9} {r.get('captured_per_s', ''):>10} {r['p50_ms']:>7} {r['p99_ms']:>7}"
        row += (
            f" {r['errors']:>6} {r.get('missing_after_drain', ''):>7} {r.get('calls_per_commit', ''):>10} |"
        )
        if "cpu_ms_per_captured_call" in r:
            cpu = r["cpu_ms_per_captured_call"]
            row += f" {cpu['gateways']} / {cpu['postgres']} / {cpu['upstream_and_load_generator']}"
        lines.append(row)
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=20.0, help="measured load per target")
    parser.add_argument("--warmup-seconds", type=float, default=3.0, help="unmeasured load before each")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 3], help="gateway replica counts")
    parser.add_argument("--writers", type=int, nargs="+", default=[1, 3], help="capture writers, no gateway")
    parser.add_argument("--writer-calls", type=int, default=30_000, help="calls each writer target stores")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.concurrency < 1 or min(args.replicas) < 1:
        parser.error("--seconds, --concurrency and --replicas must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    results = asyncio.run(benchmark(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    logger.info("\n%s\nresults written to %s", format_table(results["results"]), args.out)


if __name__ == "__main__":
    main()
