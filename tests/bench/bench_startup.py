"""How fast `kaizen serve` becomes ready and how much memory it holds: upstream engine, SQLite, scheduler on.

Each run starts ``python -m gateway serve`` in a fresh data directory against the scripted upstream, polls
``/readyz`` until it answers 200 (the time reported), then reads the child's resident set size from
``/proc`` (Linux) and stops it. ``--code DIR`` (repeatable) runs a checkout's code (its root goes on
PYTHONPATH), so versions are compared with the same interpreter and packages; their runs alternate, so load on
the machine hits each alike.

    python -m tests.bench.bench_startup [--runs 5] [--code /path/to/main --code .] [--out tests/bench/results/startup.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from tests.support.ports import free_port
from tests.support.scripted_upstream import ScriptedUpstream

logger = logging.getLogger("bench_startup")

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = Path(__file__).parent / "results" / "startup.json"
READY_TIMEOUT_S = 120.0


def _memory_kib(pid: int) -> dict[str, int]:
    """VmRSS (now) and VmHWM (peak) of a process, in KiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


def one_run(code: Path, upstream_url: str) -> dict[str, Any]:
    """Start one gateway, wait for /readyz 200, measure, stop it."""
    with tempfile.TemporaryDirectory(prefix="kaizen-startup-") as data:
        port = free_port()
        env = {
            **os.environ,
            "PYTHONPATH": str(code),
            "KAIZEN_ENGINE": "upstream",
            "KAIZEN_UPSTREAM_URL": upstream_url,
            "KAIZEN_DATA_DIR": data,
            "KAIZEN_DATABASE_URL": "",
            "KAIZEN_PORT": str(port),
            "KAIZEN_HOST": "127.0.0.1",
            "KAIZEN_LOG_LEVEL": "warning",
        }
        started = time.perf_counter()
        child = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve"],
            env=env,
            cwd=data,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = started + READY_TIMEOUT_S
            while True:
                if child.poll() is not None:
                    raise RuntimeError(f"kaizen serve exited with {child.returncode}")
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1.0).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.perf_counter() > deadline:
                    raise TimeoutError("kaizen serve did not become ready")
                time.sleep(0.02)
            ready_s = time.perf_counter() - started
            memory = _memory_kib(child.pid)
        finally:
            child.send_signal(signal.SIGTERM)
            child.wait(timeout=30)
    return {"ready_s": ready_s, "rss_mib": memory["VmRSS"] / 1024, "peak_rss_mib": memory["VmHWM"] / 1024}


def _summary(code: Path, runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "code": str(code),
        "runs": runs,
        "median_ready_s": statistics.median(r["ready_s"] for r in runs),
        "median_rss_mib": statistics.median(r["rss_mib"] for r in runs),
        "median_peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in runs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5, help="Runs of each checkout.")
    parser.add_argument(
        "--code", type=Path, action="append", help="Checkout whose code runs (repeatable; default: this one)."
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    codes = [code.resolve() for code in args.code or [REPO]]
    runs: dict[Path, list[dict[str, Any]]] = {code: [] for code in codes}
    with ScriptedUpstream() as upstream:
        for _ in range(args.runs):
            for code in codes:
                runs[code].append(one_run(code, upstream.url))
    summaries = [_summary(code, code_runs) for code, code_runs in runs.items()]
    result = {"python": platform.python_version(), "cpus": os.cpu_count(), "checkouts": summaries}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for summary in summaries:
        logger.info(
            "%s: ready in %.2f s, RSS %.0f MiB (peak %.0f MiB), median of %d runs",
            summary["code"],
            summary["median_ready_s"],
            summary["median_rss_mib"],
            summary["median_peak_rss_mib"],
            args.runs,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
