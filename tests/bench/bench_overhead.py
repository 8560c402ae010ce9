"""Latency and throughput the gateway adds on top of its upstream.

Starts the scripted upstream and the gateway (``python -m gateway serve`` in upstream mode) as
subprocesses on loopback, then sends the same small chat request straight to the upstream and
through the gateway in alternating batches, so drift (thermal, other load) hits both sides alike.
Latency is per call to the last byte (streams included); "added" is gateway minus direct at the
same percentile. ``--self-test`` puts a second scripted upstream where the gateway would be, which
checks the harness itself: the added latency should be about zero.

    python -m tests.bench.bench_overhead [--self-test] [--out tests/bench/results/overhead.json]

``--privacy mask`` (or ``hash``) stores the model as a policy whose `privacy` section redacts calls, to measure
what redaction adds (compare with a run without it; ``--prompt`` sets what is scanned).

``--variant NAME:KEY=VALUE,...`` (repeatable) starts one gateway per variant, each with those settings on top
of the others, and alternates all of them with the direct target in the same rounds: an A/B of settings under
the same load (e.g. ``--variant off:KAIZEN_METRICS=false --variant on:KAIZEN_METRICS=true``). A variant with
``KAIZEN_OTEL_TRACES=true`` exports to an OTLP receiver the benchmark starts. Every gateway's CPU time is
sampled around its batches: ``cpu_us_per_request`` is a cost that other load on the machine inflates far less
than latency.

``--cpu-split`` also charges each batch's CPU time to every process that worked for it: the load generator, the
upstream, the gateway's serving processes, its capture writers, and the whole machine (every core, from
`/proc/stat`). Each batch's window then stays open ``--settle-s`` after its last answer, so that the writer's
commits of that batch are counted with it (latency and req/s are timed without the pause). On a machine whose
cores are all busy, the whole machine's CPU per call is what sets how many calls a second fit: the split says
which process a gain would have to come from.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from tests.support.ports import free_port

logger = logging.getLogger("bench_overhead")

STARTUP_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 30.0
DEFAULT_OUT = Path(__file__).parent / "results" / "overhead.json"


@dataclass(frozen=True)
class Target:
    """One side of the comparison: where chat requests go and how to tell it is up."""

    name: str
    chat_url: str
    health_url: str
    pid: int = 0  # a process whose CPU time is charged to this target's batches (0: none)


#: What `--cpu-split` charges each batch's CPU time to, in the order its table prints them.
CPU_PARTS = ("load generator", "upstream", "serving", "capture writer", "machine")


@dataclass
class Samples:
    """Everything measured for one target in one scenario, pooled over its batches."""

    latencies_s: list[float] = field(default_factory=list)
    errors: int = 0
    busy_s: float = 0.0
    cpu_s: float = 0.0  # CPU time of the target's process during its batches
    batch_rates: list[float] = field(default_factory=list)
    cpu_parts_s: dict[str, float] = field(default_factory=dict)  # `--cpu-split`: CPU time by part

    def summary(self) -> dict[str, Any]:
        ordered = sorted(self.latencies_s)
        ok = len(ordered)
        requests = ok + self.errors
        return {
            "requests": requests,
            "errors": self.errors,
            "p50_ms": percentile(ordered, 50) * 1000,
            "p90_ms": percentile(ordered, 90) * 1000,
            "p99_ms": percentile(ordered, 99) * 1000,
            "mean_ms": (sum(ordered) / ok * 1000) if ok else math.nan,
            "req_per_s": ok / self.busy_s if self.busy_s else math.nan,
            "cpu_us_per_request": self.cpu_s / requests * 1e6 if self.cpu_s and requests else math.nan,
            **(
                {"cpu_us_per_request_by_part": {k: v / requests * 1e6 for k, v in self.cpu_parts_s.items()}}
                if self.cpu_parts_s and requests
                else {}
            ),
        }


def percentile(ordered: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile of already sorted values (no interpolation between samples)."""
    if not ordered:
        return math.nan
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]


class Processes:
    """Subprocesses this benchmark started; stopped in reverse order, each by its own handle."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.running: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(
        self, name: str, cmd: Sequence[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        log = (self.log_dir / f"{name}.log").open("wb")
        logger.info("starting %s: %s", name, shlex.join(cmd))
        process = subprocess.Popen(
            list(cmd), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=Path(__file__).resolve().parents[2]
        )
        log.close()
        self.running.append((name, process))
        return process

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.log_dir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def stop_all(self) -> None:
        for name, process in reversed(self.running):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    logger.warning("%s ignored SIGTERM; killing it", name)
                    process.kill()
                    process.wait()
        self.running.clear()


async def wait_healthy(
    session: aiohttp.ClientSession, target: Target, process: subprocess.Popen[bytes], processes: Processes
) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"{target.name} exited with {process.returncode}:\n{processes.log_tail(target.name)}"
            )
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with session.get(target.health_url, timeout=aiohttp.ClientTimeout(total=2)) as response:
                if response.status == 200:
                    return
        await asyncio.sleep(0.1)
    raise RuntimeError(
        f"{target.name} not healthy after {STARTUP_TIMEOUT_S:.0f}s:\n{processes.log_tail(target.name)}"
    )


@dataclass(frozen=True)
class Load:
    """The request every call of a scenario sends, and how many are in flight at once."""

    body: bytes
    headers: dict[str, str]
    stream: bool
    concurrency: int


def serving_cpu_s(process: psutil.Process) -> float:
    """CPU seconds of a gateway's serving processes: the process itself and its serving workers (not the
    capture writers, whose work is not per request)."""
    serving = [process, *(c for c in process.children() if "gateway.workers" in " ".join(c.cmdline()))]
    return sum(sum(p.cpu_times()[:2]) for p in serving)


def machine_busy_s() -> float:
    """CPU seconds every core of the machine has spent on anything but idling, since boot."""
    times = psutil.cpu_times()
    return float(sum(times) - times.idle - getattr(times, "iowait", 0.0))


@dataclass(frozen=True)
class CpuSplit:
    """`--cpu-split`: how long each batch's window stays open after its last answer, and the upstream's process."""

    settle_s: float
    upstream_pid: int


def cpu_parts_s(target: Target, upstream_pid: int) -> dict[str, float]:
    """Cumulative CPU seconds of each part `--cpu-split` reports, for a batch of `target`: a direct target has no
    serving process or capture writer of its own (other gateways' idle work counts only in "machine")."""
    serving = writer = 0.0
    if target.pid:
        gateway = psutil.Process(target.pid)
        serving = serving_cpu_s(gateway)
        for process in gateway.children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                if "gateway.capture.writer" in " ".join(process.cmdline()):
                    writer += sum(process.cpu_times()[:2])
    return {
        "load generator": sum(psutil.Process().cpu_times()[:2]),
        "upstream": sum(psutil.Process(upstream_pid).cpu_times()[:2]),
        "serving": serving,
        "capture writer": writer,
        "machine": machine_busy_s(),
    }


async def run_batch(
    session: aiohttp.ClientSession,
    target: Target,
    load: Load,
    count: int,
    into: Samples,
    *,
    split: CpuSplit | None = None,
) -> None:
    """Send ``count`` requests with ``load.concurrency`` in flight; a request fails unless it is 200
    and, for streams, ends with ``[DONE]``. With `split` (`--cpu-split`), CPU time by part is counted from
    the batch's start to its `settle_s` after its end."""
    remaining = count

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            started = time.perf_counter()
            try:
                async with session.post(target.chat_url, data=load.body, headers=load.headers) as response:
                    payload = await response.read()
                    ok = response.status == 200 and (not load.stream or payload.endswith(b"data: [DONE]\n\n"))
            except (TimeoutError, aiohttp.ClientError):
                ok = False
            if ok:
                into.latencies_s.append(time.perf_counter() - started)
            else:
                into.errors += 1

    process = psutil.Process(target.pid) if target.pid else None
    cpu_before = serving_cpu_s(process) if process is not None else 0.0
    parts_before = cpu_parts_s(target, split.upstream_pid) if split is not None else {}
    started, errors_before = time.perf_counter(), into.errors
    await asyncio.gather(*(worker() for _ in range(load.concurrency)))
    elapsed = time.perf_counter() - started
    if process is not None:
        into.cpu_s += serving_cpu_s(process) - cpu_before
    if split is not None:
        await asyncio.sleep(split.settle_s)  # a benchmark's window, not a wait for a condition
        for part, spent in cpu_parts_s(target, split.upstream_pid).items():
            into.cpu_parts_s[part] = into.cpu_parts_s.get(part, 0.0) + spent - parts_before[part]
    into.busy_s += elapsed
    into.batch_rates.append((count - (into.errors - errors_before)) / elapsed)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Collector pauses in the load generator would show up as latency of whichever side is running."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _against(
    gateway: Samples, direct: Samples, baseline: Samples | None = None
) -> dict[str, float | dict[str, float]]:
    """A gateway's figures next to the direct target's (and, for a variant, the first variant's)."""
    g, d = gateway.summary(), direct.summary()
    compared: dict[str, float | dict[str, float]] = {
        "summary": g,
        "added_p50_ms": g["p50_ms"] - d["p50_ms"],
        "added_p99_ms": g["p99_ms"] - d["p99_ms"],
        "req_per_s_ratio_paired": statistics.median(
            gw / dr for gw, dr in zip(gateway.batch_rates, direct.batch_rates, strict=True)
        ),
    }
    if baseline is not None:
        b = baseline.summary()
        compared["vs_first_variant"] = {
            "p50_ms": g["p50_ms"] - b["p50_ms"],
            "p99_ms": g["p99_ms"] - b["p99_ms"],
            "cpu_us_per_request": g["cpu_us_per_request"] - b["cpu_us_per_request"],
            "req_per_s_ratio_paired": statistics.median(
                gw / base for gw, base in zip(gateway.batch_rates, baseline.batch_rates, strict=True)
            ),
        }
    return compared


async def run_scenario(
    session: aiohttp.ClientSession,
    direct: Target,
    gateways: Sequence[Target],
    args: argparse.Namespace,
    *,
    stream: bool,
    concurrency: int,
    upstream_pid: int,
) -> dict[str, Any]:
    request: dict[str, Any] = {"model": args.model, "messages": [{"role": "user", "content": args.prompt}]}
    if stream:
        request["stream"] = True
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {args.api_key}"}
    load = Load(json.dumps(request).encode(), headers, stream, concurrency)
    batch = args.serial_batch if concurrency == 1 else args.concurrent_batch
    targets = [direct, *gateways]
    samples = {target.name: Samples() for target in targets}
    for target in targets:
        await run_batch(session, target, load, args.warmup, Samples())
    for round_no in range(args.rounds):
        # Every target goes first, and last, as often as the others: drift hits them alike.
        shift = round_no // 2 % len(targets)
        order = targets[shift:] + targets[:shift]
        for target in order if round_no % 2 == 0 else reversed(order):
            with gc_paused():
                await run_batch(
                    session,
                    target,
                    load,
                    batch,
                    samples[target.name],
                    split=CpuSplit(args.settle_s, upstream_pid) if args.cpu_split else None,
                )
    gateway = gateways[0]
    d, g = samples[direct.name].summary(), samples[gateway.name].summary()
    result = {
        "stream": stream,
        "concurrency": concurrency,
        "direct": d,
        "gateway": g,
        "added_p50_ms": g["p50_ms"] - d["p50_ms"],
        "added_p99_ms": g["p99_ms"] - d["p99_ms"],
        "req_per_s_ratio": g["req_per_s"] / d["req_per_s"],
        # Each gateway batch against the direct batch next to it, then the median: robust to bursts of
        # unrelated load on a shared machine, which the pooled ratio is not.
        "req_per_s_ratio_paired": statistics.median(
            gw / dr
            for gw, dr in zip(
                samples[gateway.name].batch_rates, samples[direct.name].batch_rates, strict=True
            )
        ),
    }
    if args.cpu_split:
        summaries = {target.name: samples[target.name].summary() for target in targets}
        result["cpu_split"] = {
            name: {key: summary[key] for key in ("cpu_us_per_request_by_part", "req_per_s")}
            for name, summary in summaries.items()
        }
    if len(gateways) > 1:
        first = samples[gateway.name]
        result["variants"] = {
            target.name: _against(
                samples[target.name], samples[direct.name], first if target is not gateway else None
            )
            for target in gateways
        }
    logger.info(
        "done: stream=%s concurrency=%d added p50 %.3f ms, p99 %.3f ms",
        stream,
        concurrency,
        result["added_p50_ms"],
        result["added_p99_ms"],
    )
    return result


def format_table(scenarios: Sequence[dict[str, Any]]) -> str:
    header = (
        f"{'mode':<10} {'conc':>4} | {'p50 direct':>10} {'gateway':>9} {'added':>9} | "
        f"{'p99 direct':>10} {'gateway':>9} {'added':>9} | {'req/s direct':>12} {'gateway':>8} {'ratio':>6}"
        f" | {'errors':>6}"
    )
    lines = [header, "-" * len(header)]
    for s in scenarios:
        d, g = s["direct"], s["gateway"]
        lines.append(
            f"{'stream' if s['stream'] else 'non-stream':<10} {s['concurrency']:>4} | "
            f"{d['p50_ms']:>10.3f} {g['p50_ms']:>9.3f} {s['added_p50_ms']:>9.3f} | "
            f"{d['p99_ms']:>10.3f} {g['p99_ms']:>9.3f} {s['added_p99_ms']:>9.3f} | "
            f"{d['req_per_s']:>12.0f} {g['req_per_s']:>8.0f} {s['req_per_s_ratio_paired']:>6.2f} | "
            f"{d['errors'] + g['errors']:>6}"
        )
    lines.append(
        "latencies in ms to the last byte; added = gateway - direct at that percentile; "
        "ratio = median over rounds of gateway/direct req/s in adjacent batches"
    )
    if any("variants" in s for s in scenarios):
        lines += ["", format_variants(scenarios)]
    if any("cpu_split" in s for s in scenarios):
        lines += ["", format_cpu_split(scenarios)]
    return "\n".join(lines)


def format_cpu_split(scenarios: Sequence[dict[str, Any]]) -> str:
    header = f"{'mode':<10} {'conc':>4} {'target':<16} | " + " ".join(f"{p:>14}" for p in CPU_PARTS)
    header += f" | {'req/s':>7}"
    lines = [header, "-" * len(header)]
    for s in scenarios:
        for name, split in s.get("cpu_split", {}).items():
            lines.append(
                f"{'stream' if s['stream'] else 'non-stream':<10} {s['concurrency']:>4} {name:<16} | "
                + " ".join(f"{split['cpu_us_per_request_by_part'][p]:>14.0f}" for p in CPU_PARTS)
                + f" | {split['req_per_s']:>7.0f}"
            )
    lines.append(
        "CPU time in us per call, counted over each batch and the --settle-s after it; machine: every core, "
        "any process"
    )
    return "\n".join(lines)


def format_variants(scenarios: Sequence[dict[str, Any]]) -> str:
    header = (
        f"{'mode':<10} {'conc':>4} {'variant':<16} | {'p50 added':>9} {'p99 added':>9} | {'cpu us/req':>10} "
        f"{'vs first':>9} | {'req/s ratio':>11}"
    )
    lines = [header, "-" * len(header)]
    for s in scenarios:
        for name, v in s["variants"].items():
            delta = v.get("vs_first_variant", {}).get("cpu_us_per_request", 0.0)
            lines.append(
                f"{'stream' if s['stream'] else 'non-stream':<10} {s['concurrency']:>4} {name:<16} | "
                f"{v['added_p50_ms']:>9.3f} {v['added_p99_ms']:>9.3f} | "
                f"{v['summary']['cpu_us_per_request']:>10.1f} {delta:>+9.1f} | {v['req_per_s_ratio_paired']:>11.2f}"
            )
    lines.append(
        "cpu us/req: the gateway process's CPU time per request during its batches; vs first: minus the first "
        "variant's; req/s ratio: against direct"
    )
    return "\n".join(lines)


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """`NAME:KEY=VALUE,KEY=VALUE` -> (name, settings)."""
    name, _, pairs = text.partition(":")
    settings = {}
    for pair in filter(None, pairs.split(",")):
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"variant {text!r}: {pair!r} is not KEY=VALUE")
        settings[key] = value
    if not name:
        raise ValueError(f"variant {text!r} has no name")
    return name, settings


def start_servers(
    processes: Processes, args: argparse.Namespace, data_dir: Path
) -> tuple[Target, list[Target], list[subprocess.Popen[bytes]]]:
    up_port, gw_port = free_port(), free_port()
    upstream_cmd = [sys.executable, "-m", "tests.support.scripted_upstream", "--port", str(up_port)]
    direct = Target(
        "upstream", f"http://127.0.0.1:{up_port}/v1/chat/completions", f"http://127.0.0.1:{up_port}/health"
    )
    started = [processes.start(direct.name, upstream_cmd)]
    if args.self_test:
        gateway_cmd = [sys.executable, "-m", "tests.support.scripted_upstream", "--port", str(gw_port)]
        started.append(processes.start("gateway", gateway_cmd))
        # The stand-in's CPU is charged as the gateway's would be.
        gateway = Target(
            "gateway",
            f"http://127.0.0.1:{gw_port}/v1/chat/completions",
            f"http://127.0.0.1:{gw_port}/health",
            pid=started[-1].pid,
        )
        return direct, [gateway], started
    env = {
        **os.environ,
        "KAIZEN_ENGINE": "upstream",
        "KAIZEN_UPSTREAM_URL": f"http://127.0.0.1:{up_port}/v1",
        "KAIZEN_PORT": str(gw_port),
        "KAIZEN_HOST": "127.0.0.1",
        "KAIZEN_DATA_DIR": str(data_dir),
        "KAIZEN_DATABASE_URL": f"sqlite:///{data_dir}/bench.db",
    }
    for assignment in args.gateway_env:
        key, _, value = assignment.partition("=")
        env[key] = value
    variants = [parse_variant(v) for v in args.variant] or [("gateway", {})]
    if any(v.get("KAIZEN_OTEL_TRACES", "").lower() in ("1", "true") for _, v in variants):
        receiver_port = free_port()
        receiver_cmd = [sys.executable, "-m", "tests.support.otlp_receiver", "--port", str(receiver_port)]
        processes.start("otlp-receiver", receiver_cmd)
        env.setdefault("KAIZEN_OTEL_ENDPOINT", f"http://127.0.0.1:{receiver_port}")
    gateways = []
    for name, settings in variants:
        port = gw_port if not gateways else free_port()
        own = data_dir / name if args.variant else data_dir
        own.mkdir(exist_ok=True)
        variant_env = {
            **env,
            "KAIZEN_PORT": str(port),
            "KAIZEN_DATA_DIR": str(own),
            "KAIZEN_DATABASE_URL": f"sqlite:///{own}/bench.db",
            **settings,
        }
        process = processes.start(name, shlex.split(args.gateway_cmd), variant_env)
        started.append(process)
        gateways.append(
            Target(
                name,
                f"http://127.0.0.1:{port}/v1/chat/completions",
                f"http://127.0.0.1:{port}/healthz",
                pid=process.pid,
            )
        )
    return direct, gateways, started


async def enable_privacy(args: argparse.Namespace, data_dir: Path, processes: Processes) -> None:
    """Make `args.model` a policy with redaction on, and wait until the gateway says it applies it."""
    from gateway.settings import async_database_url
    from storage.database import Database
    from storage.policies import create_policy

    database = Database(async_database_url(f"sqlite:///{data_dir}/bench.db"))
    async with database.session() as session:
        await create_policy(session, args.model, "base", {"privacy": {"mode": args.privacy}})
        await session.commit()
    await database.dispose()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while "calls are stored with redaction" not in processes.log_tail("gateway", lines=200):
        if time.monotonic() > deadline:
            raise RuntimeError(
                "the gateway did not pick up the privacy policy:\n" + processes.log_tail("gateway")
            )
        await asyncio.sleep(0.1)


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kaizen-bench-") as tmp:
        processes = Processes(Path(tmp))
        try:
            direct, gateways, started = start_servers(processes, args, Path(tmp))
            # No per-host limit and no DNS: the client must never be what queues requests.
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, use_dns_cache=True, force_close=False)
            timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
                for target, process in zip((direct, *gateways), started, strict=True):
                    await wait_healthy(session, target, process, processes)
                if args.privacy != "off" and not args.self_test:
                    await enable_privacy(args, Path(tmp), processes)
                scenarios = [
                    await run_scenario(
                        session,
                        direct,
                        gateways,
                        args,
                        stream=stream,
                        concurrency=concurrency,
                        upstream_pid=started[0].pid,  # the first process started is the upstream
                    )
                    for concurrency in args.concurrency
                    for stream in (False, True)
                ]
        except BaseException:
            for name, _ in processes.running[1:]:
                logger.error("%s log tail:\n%s", name, processes.log_tail(name))
            raise
        finally:
            processes.stop_all()
    return {
        "benchmark": "gateway overhead",
        "self_test": args.self_test,
        "gateway_cmd": None if args.self_test else args.gateway_cmd,
        "settings": {key: value for key, value in vars(args).items() if key not in {"out", "api_key"}},
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "aiohttp": aiohttp.__version__,
        },
        "unix_time": int(time.time()),
        "scenarios": scenarios,
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--gateway-cmd",
        default=f"{shlex.quote(sys.executable)} -m gateway serve",
        help="command that starts the gateway (KAIZEN_* env is set for it)",
    )
    parser.add_argument(
        "--gateway-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for the gateway; repeatable",
    )
    parser.add_argument(
        "--self-test",
        action="store_true",
        help="a second scripted upstream stands in for the gateway (added latency ~0)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE,...",
        help="a gateway with these settings, alternated with the others in every round; repeatable",
    )
    parser.add_argument(
        "--privacy",
        choices=["off", "mask", "hash"],
        default="off",
        help="redaction mode of the model's policy",
    )
    parser.add_argument("--model", default="scripted-1")
    parser.add_argument("--prompt", default="hello")
    parser.add_argument("--api-key", default="bench", help="sent as a bearer token to both sides")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--rounds", type=int, default=16, help="alternating batches per side and scenario")
    parser.add_argument("--serial-batch", type=int, default=120, help="requests per batch at concurrency 1")
    parser.add_argument("--concurrent-batch", type=int, default=600, help="requests per batch above 1")
    parser.add_argument("--warmup", type=int, default=200, help="unmeasured requests per side and scenario")
    parser.add_argument(
        "--cpu-split",
        action="store_true",
        help="charge each batch's CPU time to the load generator, upstream, serving processes, capture writers "
        "and the whole machine",
    )
    parser.add_argument(
        "--settle-s",
        type=float,
        default=0.3,
        help="with --cpu-split: how long each batch's CPU window stays open after its last answer",
    )
    args = parser.parse_args(argv)
    if min(args.concurrency) < 1 or min(args.rounds, args.serial_batch, args.concurrent_batch) < 1:
        parser.error("concurrency, rounds and batch sizes must be positive")
    if args.settle_s < 0:
        parser.error("--settle-s must not be negative")
    if args.variant and (args.self_test or args.privacy != "off"):
        parser.error("--variant goes with neither --self-test nor --privacy")
    try:
        [parse_variant(v) for v in args.variant]
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        import uvloop
    except ImportError:  # optional: a faster loop only makes the load generator lighter
        run = asyncio.run
    else:
        run = uvloop.run
    results = run(benchmark(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    logger.info("\n%s\nresults written to %s", format_table(results["scenarios"]), args.out)


if __name__ == "__main__":
    main()
