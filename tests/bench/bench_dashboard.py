"""Dashboard pages with a million captured calls, on SQLite and PostgreSQL, with and without what migration
0019 added, side by side in one run.

Loads synthetic traffic (1M calls over 30 days in about 570k episodes of three policies, six versions each,
rewards on half the episodes, judge groups, training runs and promotions) into a fresh database of each
kind, builds the rollup once (timed), starts a real gateway on it (uvicorn on loopback), logs into the
dashboard and times every page over HTTP: the first request (cold), the median and worst of the following
ones, and the median CPU time a request cost (the gateway's process and the PostgreSQL server's: the figure a
loaded machine does not inflate). Then it times the same pages as they were before 0019: its indexes
dropped and the rollup out of reach (its lock held, its state emptied, so every window sums the raw rows).

Beside the pages: what keeping the rollup costs (a refresh with nothing to do, re-summing one marked day),
and on PostgreSQL what the trigram indexes cost the capture writer (CPU of the server per call written, with
and without them, alternated in the same run).

    python -m tests.bench.bench_dashboard [--calls 1000000] [--rounds 5] [--out tests/bench/results/dashboard.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import subprocess
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import httpx
from sqlalchemy import text

from gateway.settings import Settings, async_database_url
from migrations.runner import upgrade_database
from storage.calls import write_calls
from storage.database import Database
from storage.locks import acquire_lock
from storage.rollups import LOCK_KEY, mark_span, refresh_rollups
from tests.bench.bench_writer import make_record
from tests.support.dashboard import login
from tests.support.gateway_server import GatewayServer
from tests.support.postgres import PostgresServer, find_bin_dir
from tests.support.synthetic_traffic import load

log = logging.getLogger("bench_dashboard")
ADMIN = "bench-admin"
NEW_INDEXES = ("ix_calls_adapter_version_created_at",)
TRIGRAM_INDEXES = ("ix_calls_request_trgm", "ix_calls_response_trgm")  # PostgreSQL only


def pages(sample_episode: str, middle: str, cursor: str, run_id: int) -> dict[str, str]:
    """The page requests timed, by name."""
    return {
        "overview 24h": "/dashboard?window=24h",
        "overview 7d": "/dashboard?window=7d",
        "overview 30d": "/dashboard?window=30d",
        "overview 30d, one policy": "/dashboard?window=30d&policy=support",
        "episodes, first page": "/dashboard/episodes",
        "episodes, one policy": "/dashboard/episodes?policy=triage",
        "episodes, one version": "/dashboard/episodes?version=2",
        "episodes, reward 0.9-1": "/dashboard/episodes?min_reward=0.9&max_reward=1",
        "episodes, with feedback": "/dashboard/episodes?feedback=yes",
        "episodes, unrewarded": "/dashboard/episodes?rewarded=no",
        "episodes, source import": "/dashboard/episodes?source=import",
        "episodes, last day": f"/dashboard/episodes?since={(datetime.now(UTC) - timedelta(days=1)).date().isoformat()}",
        "episodes, text (common word)": "/dashboard/episodes?q=warranty",
        "episodes, text (rare: one episode)": "/dashboard/episodes?"
        + str(httpx.QueryParams({"q": f"customer {int(middle[2:])} asks"})),
        "episodes, page in the middle": "/dashboard/episodes?" + str(httpx.QueryParams({"after": cursor})),
        "trajectory": f"/dashboard/episodes/{sample_episode}",
        "review queue, head": "/dashboard/review",
        "review queue, next": f"/dashboard/review?after={sample_episode}&part=unrewarded",
        "policies": "/dashboard/policies",
        "policy": "/dashboard/policies/support",
        "runs": "/dashboard/runs",
        "run": f"/dashboard/runs/{run_id}",
        "judge 7d": "/dashboard/judge?window=7d",
        "judge 30d": "/dashboard/judge?window=30d",
    }


def _postgres_cpu_s(data_dir: Path) -> float:
    """CPU seconds used so far by a PostgreSQL server: the postmaster and every backend it started."""
    postmaster = int((data_dir / "postmaster.pid").read_text().split()[0])
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process ended meanwhile
        pid, parent = int(stat.parent.name), int(fields[1])
        if postmaster in (pid, parent):
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def _cpu(postgres_data: Path | None) -> float:
    return time.process_time() + (_postgres_cpu_s(postgres_data) if postgres_data is not None else 0.0)


def time_pages(
    client: httpx.Client, requests: dict[str, str], rounds: int, postgres_data: Path | None
) -> dict[str, dict[str, float]]:
    """Wall time of each request, and the CPU time it cost: this process (gateway, SQLite, the client) plus
    the PostgreSQL server's, which is what a loaded machine does not inflate."""
    out: dict[str, dict[str, float]] = {}
    for name, path in requests.items():
        timings, cpu_ms = [], []
        for _ in range(rounds + 1):
            started, cpu_started = time.perf_counter(), _cpu(postgres_data)
            response = client.get(path, follow_redirects=False)
            timings.append((time.perf_counter() - started) * 1000)
            cpu_ms.append((_cpu(postgres_data) - cpu_started) * 1000)
            if response.status_code not in (200, 303):
                raise RuntimeError(f"{name}: {response.status_code} {response.text[:300]}")
        out[name] = {
            "cold_ms": round(timings[0], 1),
            "median_ms": round(statistics.median(timings[1:]), 1),
            "max_ms": round(max(timings[1:]), 1),
            "median_cpu_ms": round(statistics.median(cpu_ms[1:]), 1),
        }
        log.info(
            "%-38s cold %8.1f ms  median %8.1f ms  max %8.1f ms  cpu %8.1f ms",
            name,
            timings[0],
            out[name]["median_ms"],
            out[name]["max_ms"],
            out[name]["median_cpu_ms"],
        )
    return out


async def _scalar(url: str, sql: str) -> Any:
    database = Database(url)
    try:
        async with database.engine.connect() as conn:
            return (await conn.execute(text(sql))).scalar_one()
    finally:
        await database.dispose()


async def _as_before_0019(url: str) -> None:
    """The database as the dashboard found it before migration 0019: without its indexes, and with the rollup
    out of reach (emptied, and its lock held by this benchmark, so no page can build it again)."""
    database = Database(url)
    async with database.engine.begin() as conn:
        postgres = conn.dialect.name == "postgresql"
        for name in NEW_INDEXES + (TRIGRAM_INDEXES if postgres else ()):
            await conn.execute(text(f"DROP INDEX {name}"))
        await conn.execute(text("DELETE FROM traffic_rollups"))
        await conn.execute(text("DELETE FROM rollup_state"))
        await conn.execute(text("ANALYZE"))
    async with database.session() as session:
        assert await acquire_lock(session, LOCK_KEY, "bench-dashboard", "rollups", 86_400)
    await database.dispose()


async def _rollup_costs(url: str, postgres_data: Path | None) -> dict[str, Any]:
    """Build the rollup from nothing (what the first refresh after the upgrade does), then what keeping it
    costs: a refresh with nothing to do, and one that re-sums a marked day."""
    database = Database(url)
    out: dict[str, Any] = {}
    try:
        for name in ("build", "nothing_to_do", "one_marked_day"):
            if name == "one_marked_day":
                async with database.session() as session:
                    day = datetime.now(UTC) - timedelta(days=10)
                    await mark_span(session, day, day + timedelta(days=1))
                    await session.commit()
            started, cpu = time.perf_counter(), _cpu(postgres_data)
            report = await refresh_rollups(database)
            assert report is not None
            out[name] = {
                "wall_s": round(time.perf_counter() - started, 2),
                "cpu_s": round(_cpu(postgres_data) - cpu, 2),
                "buckets": report.buckets,
                "rows_written": report.rows,
            }
            log.info("rollup %-15s %s", name, out[name])
        async with database.engine.connect() as conn:
            out["rows"] = (await conn.execute(text("SELECT count(*) FROM traffic_rollups"))).scalar_one()
    finally:
        await database.dispose()
    return out


async def _analyze(url: str) -> None:
    """Fresh planner statistics; on PostgreSQL also a VACUUM, so that autovacuum's work after the bulk load
    does not run (and spend CPU) while pages are timed."""
    if url.startswith("postgresql"):
        connection = await asyncpg.connect(url.replace("postgresql+asyncpg", "postgresql"))
        await connection.execute("VACUUM ANALYZE")
        await connection.close()
        return
    database = Database(url)
    async with database.engine.begin() as conn:
        await conn.execute(text("ANALYZE"))
    await database.dispose()


def bench_database(
    kind: str, url: str, calls: int, rounds: int, data_dir: Path, postgres_data: Path | None = None
) -> dict[str, Any]:
    url = async_database_url(url)
    counts = asyncio.run(load(url, calls))
    asyncio.run(_analyze(url))
    log.info("%s: loaded %s", kind, counts)
    result: dict[str, Any] = {"counts": counts, "rollup": asyncio.run(_rollup_costs(url, postgres_data))}
    asyncio.run(_analyze(url))
    middle = asyncio.run(
        _scalar(url, f"SELECT id FROM episodes ORDER BY created_at LIMIT 1 OFFSET {counts['episodes'] // 2}")
    )
    created = asyncio.run(_scalar(url, f"SELECT created_at FROM episodes WHERE id = '{middle}'"))
    created = datetime.fromisoformat(created) if isinstance(created, str) else created
    cursor = f"{created.replace(tzinfo=created.tzinfo or UTC).isoformat()}~{middle}"
    sample = asyncio.run(_scalar(url, "SELECT episode_id FROM calls WHERE position = 2 LIMIT 1"))
    run_id = int(asyncio.run(_scalar(url, "SELECT max(id) FROM training_runs")))
    requests = pages(sample, middle, cursor, run_id)
    for label in ("with_0019", "before_0019"):
        if label == "before_0019":
            asyncio.run(_as_before_0019(url))
        settings = Settings.load(
            data_dir=data_dir / kind,
            database_url=url,
            engine="upstream",
            upstream_url="http://127.0.0.1:9/v1",
            scheduler=False,
            admin_key=ADMIN,
            port=0,
        )
        server = GatewayServer(settings, startup_timeout_s=120).start()
        try:
            client = login(server.url, ADMIN)
            client.timeout = httpx.Timeout(600)
            try:
                result[label] = time_pages(client, requests, rounds, postgres_data)
            finally:
                client.close()
        finally:
            server.stop()
    return result


async def _trigram_write_cost(server: PostgresServer, batches: int, batch_size: int) -> dict[str, Any]:
    """CPU the PostgreSQL server spends per call the capture writer stores, with the trigram indexes and
    without them: two databases, batches of `batch_size` calls written to each in turn."""
    urls = {}
    for variant in ("with_trigram", "without_trigram"):
        url = async_database_url(server.create_database(f"write_{variant}"))
        await upgrade_database(url)
        if variant == "without_trigram":
            connection = await asyncpg.connect(url.replace("postgresql+asyncpg", "postgresql"))
            for name in TRIGRAM_INDEXES:
                await connection.execute(f"DROP INDEX {name}")
            await connection.close()
        urls[variant] = url
    databases = {variant: Database(url) for variant, url in urls.items()}
    spent = {variant: 0.0 for variant in urls}
    try:
        for batch in range(batches + 1):  # the first batch of each warms up and is not counted
            for variant, database in databases.items():
                records = [make_record(batch * batch_size + n) for n in range(batch_size)]
                cpu = _postgres_cpu_s(server.data)
                async with database.session() as session:
                    assert await write_calls(session, records) == batch_size
                if batch:
                    spent[variant] += _postgres_cpu_s(server.data) - cpu
    finally:
        for database in databases.values():
            await database.dispose()
    per_call = {
        variant: round(seconds / (batches * batch_size) * 1e6, 1) for variant, seconds in spent.items()
    }
    out = {
        "calls_each": batches * batch_size,
        "batch_size": batch_size,
        "server_cpu_us_per_call": per_call,
        "trigram_us_per_call": round(per_call["with_trigram"] - per_call["without_trigram"], 1),
    }
    log.info("trigram write cost %s", out)
    return out


def _uptime() -> str:
    return subprocess.run(["uptime"], check=True, capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--databases", default="sqlite,postgres")
    parser.add_argument("--write-batches", type=int, default=100, help="batches of 50 calls per variant")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("httpx", "alembic", "gateway", "uvicorn"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    results: dict[str, Any] = {
        "calls": args.calls,
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "uptime_before": _uptime(),
        "load_average_before": os.getloadavg(),
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    root = Path(tempfile.mkdtemp(prefix="kaizen-bench-dashboard-"))
    kinds = args.databases.split(",")
    if "sqlite" in kinds:
        results["sqlite"] = bench_database(
            "sqlite", f"sqlite:///{root / 'bench.db'}", args.calls, args.rounds, root
        )
    if "postgres" in kinds:
        bin_dir = find_bin_dir()
        if bin_dir is None:
            raise SystemExit("PostgreSQL server binaries not found (Debian's postgresql package)")
        server = PostgresServer(bin_dir)
        server.init()
        server.start()
        server.wait_ready()
        try:
            url = server.create_database("bench_dashboard")
            results["postgres"] = bench_database("postgres", url, args.calls, args.rounds, root, server.data)
            results["postgres"]["trigram_write_cost"] = asyncio.run(
                _trigram_write_cost(server, args.write_batches, 50)
            )
        finally:
            server.destroy()
    results["load_average_after"] = os.getloadavg()
    results["uptime_after"] = _uptime()
    text_out = json.dumps(results, indent=2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text_out + "\n")
    print(text_out)


if __name__ == "__main__":
    main()
