"""Capture writer throughput alone: rows/s from `CaptureSink.submit` into SQLite and PostgreSQL, and the CPU
each row costs the serving process, the writer process and the PostgreSQL server.

Submits a burst of chat-sized records (a short conversation, token ids and logprobs, as the vLLM engine
returns them) through the real sink (capture log append included) and times until every one is committed. CPU
time per row does not depend on how busy the machine is, so it is the figure to compare on a shared one. The
served rate of one gateway (`bench_overhead`, c32) is the number to beat.

    python -m tests.bench.bench_writer [--records 20000] [--out results/writer.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from gateway.capture.sink import CaptureSink
from gateway.episodes import new_id
from gateway.settings import async_database_url
from migrations.runner import upgrade_database
from storage.records import CallRecord
from tests.support.postgres import PostgresServer, find_bin_dir
from tests.support.proc_stats import cpu_seconds, tree_cpu_seconds

log = logging.getLogger("bench_writer")


def make_record(n: int) -> CallRecord:
    tokens = 48
    return CallRecord(
        id=new_id(),
        client_request_id=None,
        episode_id=new_id(),
        episode_resolved=True,
        stitch_keys=[uuid.uuid4().hex[:32]],
        policy="bench",
        model="bench",
        engine_model="bench@1",
        request={
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": f"question number {n}: what is {n} times {n}?"},
            ],
            "tools": None,
            "tool_choice": None,
            "params": {"model": "bench", "temperature": 0.7},
        },
        response={
            "id": f"chatcmpl-{n}",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": f"{n * n} " * 20}}],
        },
        prompt_token_ids=list(range(40)),
        completion_token_ids=[[random.randrange(32000) for _ in range(tokens)]],
        completion_logprobs=[[-random.random() for _ in range(tokens)]],
        usage={"prompt_tokens": 40, "completion_tokens": tokens, "total_tokens": 40 + tokens},
        latency_ms=12.5,
        created_at=time.time(),
    )


async def measure(
    url: str, workdir: Path, records: int, batch_size: int, server_pid: int | None
) -> dict[str, Any]:
    await upgrade_database(url)
    sink = CaptureSink(url, workdir / "spool" / "log", batch_size=batch_size)
    await sink.start()
    assert sink._process is not None
    writer_pid = sink._process.pid
    burst = [make_record(n) for n in range(records)]
    cpu = (time.process_time(), cpu_seconds(writer_pid), tree_cpu_seconds(server_pid) if server_pid else 0.0)
    started = time.perf_counter()
    for record in burst:
        sink.submit(record)
    submitted = time.perf_counter() - started
    submit_cpu_s = time.process_time() - cpu[0]
    await sink.flush(timeout_s=600)
    elapsed = time.perf_counter() - started
    serving_s = time.process_time() - cpu[0]
    writer_s = cpu_seconds(writer_pid) - cpu[1]
    server_s = tree_cpu_seconds(server_pid) - cpu[2] if server_pid else None
    await sink.stop()
    assert sink.snapshot()["written"] == records, sink.snapshot()
    return {
        "records": records,
        "batch_size": batch_size,
        "submit_us_per_call": round(submitted / records * 1e6, 1),
        "submit_cpu_us_per_call": round(submit_cpu_s / records * 1e6, 1),  # the hot path's share of capture
        "seconds": round(elapsed, 3),
        "rows_per_s": round(records / elapsed),
        "serving_cpu_us_per_row": round(serving_s / records * 1e6, 1),
        "writer_cpu_us_per_row": round(writer_s / records * 1e6, 1),
        "database_server_cpu_us_per_row": None if server_s is None else round(server_s / records * 1e6, 1),
        "writer_rows_per_cpu_s": round(records / writer_s) if writer_s else None,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        sqlite_url = async_database_url(f"sqlite:///{work / 'kaizen.db'}")
        results["sqlite"] = await measure(sqlite_url, work / "s", args.records, args.batch_size, None)
        log.info("sqlite: %s", results["sqlite"])
        bin_dir = find_bin_dir()
        if bin_dir is None:
            log.warning("no PostgreSQL binaries: PostgreSQL not measured")
            return results
        server = PostgresServer(bin_dir)
        server.init()
        server.start()
        try:
            server.wait_ready()
            url = async_database_url(server.create_database("bench_writer"))
            pid = int((server.data / "postmaster.pid").read_text().split()[0])
            results["postgresql"] = await measure(url, work / "p", args.records, args.batch_size, pid)
            log.info("postgresql: %s", results["postgresql"])
        finally:
            server.destroy()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--out", type=Path, default=None, help="JSON results file")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results = asyncio.run(main_async(args))
    log.info("%s", json.dumps(results, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
