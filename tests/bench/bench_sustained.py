"""Sustained load: does capture keep up, and does the gateway's memory stay flat?

Starts the scripted upstream (its own process) and, for each database (SQLite, and PostgreSQL from a throwaway
server), a real `kaizen serve` child in front of it; sends chat calls (every other one streamed, each with its own
text) at a fixed concurrency for ``--seconds`` straight to the upstream (the baseline) and then through each
gateway. While the load runs it samples, twice a second, the capture backlog (calls answered with 200 but not
yet rows in `calls`, counted in SQL by a separate connection), the gateway's `/admin/capture` counters and its
resident memory. When the load stops it measures how long until every answered call is a row.

    python -m tests.bench.bench_sustained [--seconds 180] [--concurrency 32] [--databases sqlite postgres]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from gateway.commands.serve_process import GatewayProcess
from tests.bench.bench_overhead import Processes, Target, percentile, wait_healthy
from tests.support import proc_stats
from tests.support.child_gateway import rss_bytes, upstream_gateway
from tests.support.ports import free_port
from tests.support.postgres import PostgresServer, find_bin_dir
from tests.support.proc_stats import child_pids, cpu_seconds
from tests.support.sql import fetch_rows

logger = logging.getLogger("bench_sustained")

DEFAULT_OUT = Path(__file__).parent / "results" / "sustained.json"
SAMPLE_S = 0.5
REQUEST_TIMEOUT_S = 30.0
DRAIN_TIMEOUT_S = 120.0
MB = 1024 * 1024


@dataclass
class Run:
    """What one target's load measured."""

    latencies_s: list[float] = field(default_factory=list)
    errors: int = 0
    served: int = 0  # calls answered with a complete 200
    elapsed_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        ordered = sorted(self.latencies_s)
        return {
            "requests": self.served + self.errors,
            "errors": self.errors,
            "req_per_s": round(self.served / self.elapsed_s, 1) if self.elapsed_s else None,
            "p50_ms": round(percentile(ordered, 50) * 1000, 2),
            "p99_ms": round(percentile(ordered, 99) * 1000, 2),
        }


async def load(
    session: aiohttp.ClientSession,
    chat_url: str | Sequence[str],
    headers: dict[str, str],
    seconds: float,
    concurrency: int,
    run: Run | None = None,
) -> Run:
    """`concurrency` callers in a loop until the time is up; a call counts as served only when it is a 200 and,
    for streams, ends with `[DONE]`. `run` is filled in as calls finish, so a sampler can watch it. Several URLs
    (gateway replicas) take the calls in turn, as a round-robin load balancer would send them."""
    urls = [chat_url] if isinstance(chat_url, str) else list(chat_url)
    run = run or Run()
    tag = uuid.uuid4().hex[:8]
    stop_at = time.monotonic() + seconds

    async def caller(index: int) -> None:
        sequence = 0
        while time.monotonic() < stop_at:
            sequence += 1
            stream = sequence % 2 == 0
            body = {
                "model": "scripted-1",
                "messages": [{"role": "user", "content": f"sustained {tag} {index} {sequence}"}],
                "stream": stream,
            }
            started = time.perf_counter()
            try:
                target = urls[(index + sequence) % len(urls)]
                async with session.post(target, json=body, headers=headers) as response:
                    payload = await response.read()
                    ok = response.status == 200 and (not stream or payload.endswith(b"data: [DONE]\n\n"))
            except (TimeoutError, aiohttp.ClientError):
                ok = False
            if ok:
                run.latencies_s.append(time.perf_counter() - started)
                run.served += 1
            else:
                run.errors += 1

    started = time.perf_counter()
    await asyncio.gather(*(caller(i) for i in range(concurrency)))
    run.elapsed_s = time.perf_counter() - started
    return run


async def row_count(database_url: str) -> int:
    [row] = await fetch_rows(database_url, "SELECT COUNT(*) AS n FROM calls")
    return int(row["n"])


async def capture_counters(session: aiohttp.ClientSession, gateway: GatewayProcess) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {gateway.admin_key}"}
    async with session.get(f"{gateway.url}/admin/capture", headers=headers) as response:
        return dict(await response.json()) if response.status == 200 else {"status": response.status}


def capture_writer_pid(gateway: GatewayProcess) -> int | None:
    """The gateway's capture writer process (None for a gateway that writes from a thread of its own)."""
    assert gateway.process is not None
    for pid in child_pids(gateway.process.pid):
        with contextlib.suppress(OSError):
            if b"gateway.capture.writer" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    return None


async def through_gateway(
    session: aiohttp.ClientSession, gateway: GatewayProcess, database_url: str, args: argparse.Namespace
) -> dict[str, Any]:
    """Load through one gateway while sampling backlog and memory, then time the drain."""
    headers = {"Authorization": f"Bearer {gateway.api_key}"}
    chat_url = f"{gateway.url}/v1/chat/completions"
    warm = await load(session, chat_url, headers, args.warmup_seconds, args.concurrency)
    rss_start = rss_bytes(gateway)
    assert gateway.process is not None
    writer = capture_writer_pid(gateway)
    rows_start = await row_count(database_url)
    cpu_start = (cpu_seconds(gateway.process.pid), cpu_seconds(writer) if writer else 0.0)
    run = Run()
    backlog: list[int] = []
    rss: list[int] = []
    running = asyncio.create_task(load(session, chat_url, headers, args.seconds, args.concurrency, run))
    while not running.done():
        await asyncio.wait({running}, timeout=SAMPLE_S)
        # Served is read before the rows, so a call answered between the two reads is never counted as stored.
        served = warm.served + run.served
        backlog.append(max(0, served - await row_count(database_url)))
        rss.append(rss_bytes(gateway))
    await running
    counters_at_stop = await capture_counters(session, gateway)
    served = warm.served + run.served
    stopped = time.perf_counter()
    rows = await row_count(database_url)
    while rows < served and time.perf_counter() - stopped < DRAIN_TIMEOUT_S:
        await asyncio.sleep(0.05)
        rows = await row_count(database_url)
    drain_s = time.perf_counter() - stopped
    rss_end = rss_bytes(gateway)
    # CPU time per call does not depend on how loaded the machine is: the figure to compare on a shared one.
    serving_cpu_s = cpu_seconds(gateway.process.pid) - cpu_start[0]
    writer_cpu_s = cpu_seconds(writer) - cpu_start[1] if writer else None
    stored = rows - rows_start
    rate = run.served / run.elapsed_s if run.elapsed_s else 0.0
    return {
        **run.summary(),
        "serving_cpu_us_per_call": round(serving_cpu_s / run.served * 1e6, 1) if run.served else None,
        "writer_cpu_us_per_row": round(writer_cpu_s / stored * 1e6, 1) if writer_cpu_s and stored else None,
        "writer_rss_mb": round(proc_stats.rss_bytes(writer) / MB, 1) if writer else None,
        "rss_start_mb": round(rss_start / MB, 1),
        "rss_end_mb": round(rss_end / MB, 1),
        "rss_growth_mb": round((rss_end - rss_start) / MB, 1),
        "rss_max_mb": round(max(rss, default=rss_end) / MB, 1),
        "backlog_max": max(backlog, default=0),
        "backlog_mean": round(statistics.fmean(backlog), 1) if backlog else 0,
        # The backlog as time: how far behind the answers the rows are, against the flush window (50 ms).
        "backlog_max_ms": round(max(backlog, default=0) / rate * 1000, 1) if rate else None,
        "backlog_mean_ms": round(statistics.fmean(backlog) / rate * 1000, 1) if rate and backlog else None,
        "backlog_p95_ms": round(percentile(sorted(backlog), 95) / rate * 1000, 1)
        if rate and backlog
        else None,
        "backlog_samples": len(backlog),
        "backlog_series": backlog,  # rows behind at each sample: one slow moment, or a trend
        "drain_s": round(drain_s, 3),
        "served_total": served,
        "rows_total": rows,
        "missing_after_drain": served - rows,
        "capture_counters_at_stop": counters_at_stop,
    }


@contextlib.contextmanager
def database(kind: str, root: Path) -> Iterator[str]:
    """A fresh, empty database of the given kind; a PostgreSQL server lives as long as the block."""
    if kind == "sqlite":
        yield f"sqlite:///{root / 'sustained.db'}"
        return
    bin_dir = find_bin_dir()
    if bin_dir is None:
        raise RuntimeError("PostgreSQL server binaries not found (install Debian's postgresql package)")
    server = PostgresServer(bin_dir)
    server.init()
    server.start()
    try:
        server.wait_ready()
        yield server.create_database("sustained")
    finally:
        server.destroy()


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kaizen-sustained-") as tmp:
        root = Path(tmp)
        processes = Processes(root)
        port = free_port()
        upstream = Target(
            "upstream", f"http://127.0.0.1:{port}/v1/chat/completions", f"http://127.0.0.1:{port}/health"
        )
        try:
            process = processes.start(
                "upstream", [sys.executable, "-m", "tests.support.scripted_upstream", "--port", str(port)]
            )
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
            timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
                await wait_healthy(session, upstream, process, processes)
                logger.info("direct to the upstream for %.0f s", args.seconds)
                await load(session, upstream.chat_url, {}, args.warmup_seconds, args.concurrency)
                results["direct"] = (
                    await load(session, upstream.chat_url, {}, args.seconds, args.concurrency)
                ).summary()
                for kind in args.databases:
                    with database(kind, root / kind) as url:
                        gateway = upstream_gateway(root / kind, url, f"http://127.0.0.1:{port}/v1")
                        gateway.start()
                        try:
                            await gateway.wait_ready(timeout_s=120)
                            logger.info("through the gateway on %s for %.0f s", kind, args.seconds)
                            results[kind] = await through_gateway(session, gateway, url, args)
                        finally:
                            gateway.stop()
                    logger.info("%s: %s", kind, results[kind])
        finally:
            processes.stop_all()
    return {
        "benchmark": "sustained load with capture",
        "settings": {key: value for key, value in vars(args).items() if key != "out"},
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        },
        "unix_time": int(time.time()),
        "results": results,
    }


def format_table(results: dict[str, Any]) -> str:
    header = (
        f"{'target':<9} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'errors':>6} | {'RSS start':>9} {'end':>6} "
        f"{'growth':>6} | {'backlog max':>11} {'mean':>6} {'max ms':>7} {'mean ms':>7} | {'drain s':>7} "
        f"{'missing':>7} | {'us/call':>7} {'us/row':>6}"
    )
    lines = [header, "-" * len(header)]
    for name, r in results.items():
        row = f"{name:<9} {r['req_per_s']:>7} {r['p50_ms']:>7} {r['p99_ms']:>7} {r['errors']:>6} |"
        if "rss_start_mb" in r:
            row += (
                f" {r['rss_start_mb']:>9} {r['rss_end_mb']:>6} {r['rss_growth_mb']:>6} |"
                f" {r['backlog_max']:>11} {r['backlog_mean']:>6} {r['backlog_max_ms']!s:>7} {r['backlog_mean_ms']!s:>7} |"
                f" {r['drain_s']:>7} {r['missing_after_drain']:>7} | {r['serving_cpu_us_per_call']!s:>7}"
                f" {r['writer_cpu_us_per_row']!s:>6}"
            )
        lines.append(row)
    lines.append(
        "RSS in MiB (the serving process); backlog = calls answered with 200 but not yet rows in `calls`, sampled "
        "every 0.5 s, and as ms of traffic; CPU us per served call (serving process) and per stored row (writer)"
    )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=180.0, help="measured load per target")
    parser.add_argument("--warmup-seconds", type=float, default=5.0, help="unmeasured load before each")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument(
        "--databases", nargs="+", choices=["sqlite", "postgres"], default=["sqlite", "postgres"]
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.warmup_seconds < 0 or args.concurrency < 1:
        parser.error("--seconds and --concurrency must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the readiness polls
    results = asyncio.run(benchmark(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    logger.info("\n%s\nresults written to %s", format_table(results["results"]), args.out)


if __name__ == "__main__":
    main()
