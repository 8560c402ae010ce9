"""What metrics and traces cost per call, in CPU time of this process (little affected by other load).

- metrics: `CallMetrics.call`, what the request path runs per call when KAIZEN_METRICS is on (off, it runs
  nothing), over a few label combinations as real traffic has; and one scrape's rendering.
- the per-route counter: `count_responses` around an ASGI app that answers at once, against the bare app,
  for a plain answer and a stream of 20 chunks (the middleware sees every chunk go by).
- traces: `CallTracer.record`, what the request path runs per captured call when KAIZEN_OTEL_TRACES is on, and
  the same plus the batch exporter's own work (encoding, HTTP to an OTLP receiver in a child process) once
  everything is flushed: the CPU one traced call costs the gateway process in all.

    python -m tests.bench.bench_observability [--out tests/bench/results/observability.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from litestar.types import ASGIApp, Message, Receive, Scope, Send
from prometheus_client import CollectorRegistry, generate_latest

from gateway.metrics import CallMetrics, count_responses
from gateway.settings import Settings
from gateway.tracing import CallTracer
from storage.records import CallRecord
from tests.support.ports import free_port

logger = logging.getLogger("bench_observability")
DEFAULT_OUT = Path(__file__).parent / "results" / "observability.json"
LABELS = [
    ("support", "support@3", "ok", False),
    ("support", "support@3", "ok", True),
    ("triage", "triage@1", "error", False),
]


def _per_call_us(run: Any, calls: int, repeats: int) -> float:
    """The fastest of `repeats` timings of `run()` (which makes `calls` calls), per call, in CPU microseconds."""
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        run()
        best = min(best, time.process_time() - started)
    return best / calls * 1e6


def bench_metrics(calls: int, repeats: int) -> dict[str, float]:
    registry = CollectorRegistry()
    metrics = CallMetrics(registry)

    def run() -> None:
        for i in range(calls):
            model, served, status, stream = LABELS[i % 3]
            metrics.call(model, served, status, stream, 0.012, 0.004 if stream else None, 120, 48)

    per_call = _per_call_us(run, calls, repeats)
    scrape = _per_call_us(lambda: generate_latest(registry), 1, repeats)
    return {"call_us": per_call, "render_us": scrape}


def bench_route_counter(calls: int, repeats: int) -> dict[str, float]:
    """CPU per request that `count_responses` adds: the wrapped app minus the bare one, same requests."""
    metrics = CallMetrics(CollectorRegistry())

    def answering(chunks: int) -> ASGIApp:
        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for _ in range(chunks - 1):
                await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        return app

    async def sink(message: Message) -> None:
        return None

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    scopes: list[Any] = [
        {"type": "http", "method": "POST", "path_template": route, "state": {}}
        for route in ("/v1/chat/completions", "/v1/embeddings", "/v1/feedback")
    ]
    out: dict[str, float] = {}
    for name, chunks in (("plain", 1), ("stream_20_chunks", 20)):
        bare = answering(chunks)
        counted = count_responses(metrics)(bare)
        timings = {}
        for label, app in (("bare", bare), ("counted", counted)):

            async def many(app: ASGIApp = app) -> None:
                for i in range(calls):
                    await app(scopes[i % 3], receive, sink)

            timings[label] = _per_call_us(lambda many=many: asyncio.run(many()), calls, repeats)
        out[f"{name}_us"] = timings["counted"] - timings["bare"]
    return out


def _record(i: int) -> CallRecord:
    return CallRecord(
        id=f"call-{i}",
        episode_id=f"ep-{i}",
        episode_resolved=True,
        policy="support",
        model="support",
        adapter_version=3,
        engine_model="support@3",
        request={
            "messages": [{"role": "user", "content": "What is the opposite of hot?"}],
            "tools": None,
            "tool_choice": None,
            "params": {"temperature": 0.7, "max_tokens": 64},
        },
        response={
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "Cold."}, "finish_reason": "stop"}
            ]
        },
        usage={"prompt_tokens": 20, "completion_tokens": 2},
        latency_ms=12.0,
        status="ok",
        created_at=time.time(),
    )


def bench_traces(calls: int, repeats: int, content: bool) -> dict[str, float]:
    port = free_port()
    receiver = subprocess.Popen(
        [sys.executable, "-m", "tests.support.otlp_receiver", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        settings = Settings.load(
            otel_traces=True, otel_endpoint=f"http://127.0.0.1:{port}", otel_content=content
        )
        tracer = CallTracer(settings)
        records = [_record(i) for i in range(calls)]
        tracer.record(records[0], None)
        tracer.flush()
        recorded = exported = float("inf")
        parent = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
        for _ in range(repeats):
            spent_recording = spent = 0.0
            # Chunks smaller than the exporter's queue (2048 spans): a fuller queue drops spans.
            for start in range(0, calls, 1000):
                started = time.process_time()
                for record in records[start : start + 1000]:
                    tracer.record(record, parent)
                spent_recording += time.process_time() - started
                assert tracer.flush()
                spent += time.process_time() - started
            recorded, exported = min(recorded, spent_recording), min(exported, spent)
        tracer.shutdown()
    finally:
        receiver.terminate()
        receiver.wait()
    return {"record_us": recorded / calls * 1e6, "record_and_export_us": exported / calls * 1e6}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results = {
        "benchmark": "observability cost per call (CPU time, best of repeats)",
        "settings": {"calls": args.calls, "repeats": args.repeats},
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        },
        "load_average": os.getloadavg(),
        "unix_time": int(time.time()),
        "metrics": bench_metrics(args.calls * 10, args.repeats),
        "route_counter": bench_route_counter(args.calls * 10, args.repeats),
        "traces": bench_traces(args.calls, args.repeats, content=False),
        "traces_with_content": bench_traces(args.calls, args.repeats, content=True),
    }
    logger.info("%s", json.dumps(results, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
