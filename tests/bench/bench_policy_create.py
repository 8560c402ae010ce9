"""What creating a policy costs the serving process: its memory while `POST /admin/policies` builds version 0.

Each run starts a real `kaizen serve` (the scripted upstream as its engine, SQLite, no scheduler) in a fresh data
directory, waits for `/readyz`, reads the gateway's resident set (VmRSS) and peak (VmHWM) from `/proc`, creates
a policy on the embedded model's directory through the admin API, and reads them again, with the CPU time the
create cost the gateway and the children it reaped (the version-0 builder). While the request runs,
the gateway's children are sampled every 10 ms: the peak (VmHWM) of the one building version 0 is its last
sample before it exits; the peak the child logs itself (`peak RSS ... MiB`) is read from the gateway's log too.

* `before`: commit `--before-ref` (3c66e6d), where the gateway built version 0 with torch in a worker thread of
  its own, unpacked with `git archive` and run with PYTHONPATH;
* `after`: this tree, where a child process (`trainer.learner.initial_adapter`) builds it.

Runs alternate between the sides, so load on the machine hits each alike.

    python -m tests.bench.bench_policy_create [--runs 2] [--out tests/bench/results/policy_create.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.support.older_tree import check_tree, tree_env, unpack
from tests.support.ports import free_port
from tests.support.proc_stats import cpu_seconds
from tests.support.scripted_upstream import ScriptedUpstream

logger = logging.getLogger("bench_policy_create")

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = Path(__file__).parent / "results" / "policy_create.json"
#: `main` before version 0 moved into a child process: the gateway built it in a worker thread.
BEFORE_REF = "3c66e6d"
CHILD_MODULE = b"trainer.learner.initial_adapter"
ADMIN_KEY = "bench-admin"
READY_TIMEOUT_S = 300.0
CREATE_TIMEOUT_S = 900.0
SAMPLE_S = 0.01
_CHILD_PEAK = re.compile(r"version 0 ready at .* \(peak RSS (\d+) MiB\)")


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS (now) and VmHWM (peak) of a process, in KiB; empty once it has exited (a zombie has neither)."""
    fields = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0])
    return fields


def children(pid: int) -> set[int]:
    """The running children of a process, whichever of its threads started them (cheaper than a walk of /proc)."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            found.update(int(child) for child in (task / "children").read_text().split())
    return found


def _is_builder(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return CHILD_MODULE in Path(f"/proc/{pid}/cmdline").read_bytes()
    return False


def create_while_sampling(url: str, base_model: str, gateway_pid: int) -> dict[str, Any]:
    """Create a policy through the admin API; meanwhile, the peak of the child that builds version 0 (if any)."""
    answer: dict[str, Any] = {}

    def create() -> None:
        started = time.perf_counter()
        response = httpx.post(
            f"{url}/admin/policies",
            json={"name": "bench", "base_model": base_model},
            headers={"authorization": f"Bearer {ADMIN_KEY}"},
            timeout=CREATE_TIMEOUT_S,
        )
        answer.update(status=response.status_code, text=response.text, seconds=time.perf_counter() - started)

    request = threading.Thread(target=create)
    request.start()
    peaks: dict[int, int] = {}  # the builder's pid -> its last VmHWM sample
    while request.is_alive():
        for pid in children(gateway_pid) | set(peaks):
            if pid in peaks or _is_builder(pid):
                peak = memory_kib(pid).get("VmHWM")
                if peak is not None:
                    peaks[pid] = max(peaks.get(pid, 0), peak)
        time.sleep(SAMPLE_S)
    request.join()
    if answer.get("status") != 201:
        raise RuntimeError(f"creating the policy failed: {answer}")
    if len(peaks) > 1:
        raise RuntimeError(f"more than one version-0 builder was seen: {sorted(peaks)}")
    answer["child_peak_rss_mib"] = next(iter(peaks.values())) / 1024 if peaks else None
    del answer["text"]
    return answer


def one_run(code: Path, base_model: str, upstream_url: str, work: Path) -> dict[str, Any]:
    """Start one gateway on `code`, create a policy on it, measure, stop it."""
    data = Path(tempfile.mkdtemp(prefix="data-", dir=work))
    log_path = data / "gateway.log"
    port = free_port()
    env = {
        **tree_env(code),
        "KAIZEN_ENGINE": "upstream",
        "KAIZEN_UPSTREAM_URL": upstream_url,
        "KAIZEN_DATA_DIR": str(data),
        "KAIZEN_DATABASE_URL": "",
        "KAIZEN_PORT": str(port),
        "KAIZEN_HOST": "127.0.0.1",
        "KAIZEN_ADMIN_KEY": ADMIN_KEY,
        "KAIZEN_SCHEDULER": "false",
        "KAIZEN_LOG_LEVEL": "info",
    }
    url = f"http://127.0.0.1:{port}"
    with log_path.open("ab") as log:
        gateway = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve"],
            env=env,
            cwd=data,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if gateway.poll() is not None:
                raise RuntimeError(f"kaizen serve exited with {gateway.returncode}; see {log_path}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/readyz", timeout=1.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"kaizen serve was not ready in {READY_TIMEOUT_S:.0f} s; see {log_path}")
            time.sleep(0.05)
        ready, cpu_ready = memory_kib(gateway.pid), cpu_seconds(gateway.pid, with_reaped_children=True)
        created = create_while_sampling(url, base_model, gateway.pid)
        after, cpu_after = memory_kib(gateway.pid), cpu_seconds(gateway.pid, with_reaped_children=True)
    finally:
        gateway.send_signal(signal.SIGTERM)
        gateway.wait(timeout=60)
    reported = _CHILD_PEAK.search(log_path.read_text(errors="replace"))
    return {
        "create_s": round(created["seconds"], 1),
        "create_cpu_s": round(cpu_after - cpu_ready, 1),
        "gateway_rss_ready_mib": round(ready["VmRSS"] / 1024, 1),
        "gateway_peak_rss_mib": round(after["VmHWM"] / 1024, 1),
        "gateway_rss_after_mib": round(after["VmRSS"] / 1024, 1),
        "child_peak_rss_mib": None
        if created["child_peak_rss_mib"] is None
        else round(created["child_peak_rss_mib"], 1),
        "child_reported_peak_rss_mib": int(reported.group(1)) if reported else None,
    }


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [run[key] for run in runs if run[key] is not None]
    return round(statistics.median(values), 1) if values else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=2, help="Runs of each side.")
    parser.add_argument("--before-ref", default=BEFORE_REF)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    from gateway.base_models import pull_base_model

    base_model = str(pull_base_model("smollm2-135m-instruct", ROOT / "kaizen-data" / "models"))
    with tempfile.TemporaryDirectory(prefix="kaizen-bench-policy-") as tmp, ScriptedUpstream() as upstream:
        work = Path(tmp)
        before_tree = work / "before-tree"
        commit = unpack(args.before_ref, before_tree)
        trees = {"before": before_tree, "after": ROOT}
        for tree in trees.values():
            check_tree(tree)
        runs: dict[str, list[dict[str, Any]]] = {side: [] for side in trees}
        load = os.getloadavg()[0]
        for number in range(args.runs):
            for side, tree in trees.items():
                logger.info("run %d of %d: %s", number + 1, args.runs, side)
                run = one_run(tree, base_model, upstream.url, work)
                logger.info("%s: %s", side, run)
                runs[side].append(run)
    keys = (
        "create_s",
        "create_cpu_s",
        "gateway_rss_ready_mib",
        "gateway_peak_rss_mib",
        "gateway_rss_after_mib",
    )
    sides = {
        side: {
            "code": f"git archive {commit[:12]}" if side == "before" else "this checkout",
            "commit": commit if side == "before" else _head(),
            "runs": side_runs,
            **{f"median_{key}": _median(side_runs, key) for key in (*keys, "child_peak_rss_mib")},
        }
        for side, side_runs in runs.items()
    }
    result = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average_at_start": round(load, 1),
        "base_model": "smollm2-135m-instruct (embedded, bf16 directory)",
        "sides": sides,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for side, summary in sides.items():
        logger.info(
            "%s: gateway peak RSS %s MiB (%s MiB when ready, %s MiB after), version-0 child peak %s MiB, "
            "create %s s (%s s of CPU); median of %d runs",
            side,
            summary["median_gateway_peak_rss_mib"],
            summary["median_gateway_rss_ready_mib"],
            summary["median_gateway_rss_after_mib"],
            summary["median_child_peak_rss_mib"],
            summary["median_create_s"],
            summary["median_create_cpu_s"],
            args.runs,
        )
    return 0


def _head() -> str:
    return subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
