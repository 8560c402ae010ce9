"""What a `/v1/responses` call costs the gateway beside the chat completion it is translated into.

Starts the scripted upstream and the gateway (``python -m gateway serve`` in upstream mode) as subprocesses on
loopback, then sends the same one-message conversation as a chat completion and as a create in alternating
batches (non-stream and stream, concurrency 1), so drift hits both alike. Reported per kind: latency to the
last byte, and the gateway process's CPU time per request (user + system, from /proc), which other load on the
machine does not inflate the way it inflates latency.

    python -m tests.bench.bench_responses [--out tests/bench/results/responses.json]
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from tests.bench.bench_overhead import (
    REQUEST_TIMEOUT_S,
    Processes,
    Target,
    gc_paused,
    percentile,
    wait_healthy,
)
from tests.support.ports import free_port

logger = logging.getLogger("bench_responses")
DEFAULT_OUT = Path(__file__).parent / "results" / "responses.json"
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


@dataclass
class Kind:
    """One way of asking: its URL, body and what a complete answer ends with."""

    name: str
    url: str
    body: bytes
    marker: bytes  # what a complete answer holds
    latencies_s: list[float] = field(default_factory=list)
    cpu_s: float = 0.0
    requests: int = 0
    errors: int = 0

    def summary(self) -> dict[str, float]:
        ordered = sorted(self.latencies_s)
        return {
            "requests": self.requests,
            "errors": self.errors,
            "p50_ms": percentile(ordered, 50) * 1000,
            "p99_ms": percentile(ordered, 99) * 1000,
            "gateway_cpu_ms_per_request": self.cpu_s / self.requests * 1000,
        }


async def run_batch(session: aiohttp.ClientSession, kind: Kind, count: int, gateway_pid: int) -> None:
    headers = {"Content-Type": "application/json", "Authorization": "Bearer bench"}
    cpu_before = cpu_seconds(gateway_pid)
    for _ in range(count):
        started = time.perf_counter()
        try:
            async with session.post(kind.url, data=kind.body, headers=headers) as response:
                payload = await response.read()
                ok = response.status == 200 and kind.marker in payload
        except (TimeoutError, aiohttp.ClientError):
            ok = False
        if ok:
            kind.latencies_s.append(time.perf_counter() - started)
        else:
            kind.errors += 1
    kind.cpu_s += cpu_seconds(gateway_pid) - cpu_before
    kind.requests += count


def kinds(base: str, prompt: str, stream: bool) -> tuple[Kind, Kind]:
    chat: dict[str, Any] = {"model": "scripted-1", "messages": [{"role": "user", "content": prompt}]}
    create: dict[str, Any] = {"model": "scripted-1", "input": prompt}
    if stream:
        chat["stream"] = create["stream"] = True
    mode = "stream" if stream else "non-stream"
    return (
        Kind(
            f"chat {mode}",
            f"{base}/chat/completions",
            json.dumps(chat).encode(),
            b"[DONE]" if stream else b"choices",
        ),
        Kind(
            f"responses {mode}",
            f"{base}/responses",
            json.dumps(create).encode(),
            b"event: response.completed" if stream else b'"status":"completed"',
        ),
    )


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kaizen-bench-") as tmp:
        processes = Processes(Path(tmp))
        up_port, gw_port = free_port(), free_port()
        try:
            upstream = processes.start(
                "upstream", [args.python, "-m", "tests.support.scripted_upstream", "--port", str(up_port)]
            )
            env = {
                **os.environ,
                "KAIZEN_ENGINE": "upstream",
                "KAIZEN_UPSTREAM_URL": f"http://127.0.0.1:{up_port}/v1",
                "KAIZEN_PORT": str(gw_port),
                "KAIZEN_DATA_DIR": tmp,
                "KAIZEN_DATABASE_URL": f"sqlite:///{tmp}/bench.db",
            }
            gateway = processes.start("gateway", [args.python, "-m", "gateway", "serve"], env)
            connector = aiohttp.TCPConnector(limit=0, force_close=False)
            async with aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
            ) as session:
                root = f"http://127.0.0.1:{gw_port}"
                await wait_healthy(
                    session, Target("upstream", "", f"http://127.0.0.1:{up_port}/health"), upstream, processes
                )
                await wait_healthy(session, Target("gateway", "", f"{root}/healthz"), gateway, processes)
                results = []
                for stream in (False, True):
                    pair = kinds(f"{root}/v1", args.prompt, stream)
                    for kind in pair:
                        await run_batch(session, kind, args.warmup, gateway.pid)
                        kind.latencies_s.clear()
                        kind.cpu_s, kind.requests, kind.errors = 0.0, 0, 0
                    for round_no in range(args.rounds):
                        for kind in pair if round_no % 2 == 0 else pair[::-1]:
                            with gc_paused():
                                await run_batch(session, kind, args.batch, gateway.pid)
                    chat, responses = (k.summary() for k in pair)
                    results.append(
                        {
                            "stream": stream,
                            "chat": chat,
                            "responses": responses,
                            "added_p50_ms": responses["p50_ms"] - chat["p50_ms"],
                            "added_cpu_ms_per_request": responses["gateway_cpu_ms_per_request"]
                            - chat["gateway_cpu_ms_per_request"],
                        }
                    )
        finally:
            processes.stop_all()
    return {
        "benchmark": "responses vs chat completions through the gateway",
        "settings": {k: v for k, v in vars(args).items() if k not in {"out", "python"}},
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "load": os.getloadavg()},
        "unix_time": int(time.time()),
        "scenarios": results,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    parser.add_argument("--python", default=sys.executable, help="interpreter for the servers")
    parser.add_argument("--prompt", default="hello there")
    parser.add_argument("--rounds", type=int, default=10, help="alternating batches per kind")
    parser.add_argument("--batch", type=int, default=100, help="requests per batch")
    parser.add_argument("--warmup", type=int, default=100, help="unmeasured requests per kind")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results = asyncio.run(benchmark(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    for s in results["scenarios"]:
        logger.info(
            "%s: p50 chat %.2f ms, responses %.2f ms; gateway CPU per request chat %.3f ms, responses %.3f ms",
            "stream" if s["stream"] else "non-stream",
            s["chat"]["p50_ms"],
            s["responses"]["p50_ms"],
            s["chat"]["gateway_cpu_ms_per_request"],
            s["responses"]["gateway_cpu_ms_per_request"],
        )
    logger.info("results written to %s", args.out)


if __name__ == "__main__":
    main()
