"""Capture writer throughput alone: rows/s from `CaptureSink.submit` into SQLite and PostgreSQL.

Submits a burst of chat-sized records (a short conversation, token ids and logprobs, as the vLLM engine
returns them) through the real sink (capture log append included) and times until every one is committed. The
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

from gateway.capture import CaptureSink
from gateway.settings import async_database_url
from storage.database import Database
from storage.records import CallRecord
from storage.schema import upgrade_database
from tests.support.postgres import PostgresServer, find_bin_dir

log = logging.getLogger("bench_writer")


def make_record(n: int) -> CallRecord:
    tokens = 48
    return CallRecord(
        id=uuid.uuid4().hex,
        client_request_id=None,
        episode_id=uuid.uuid4().hex,
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


async def measure(url: str, workdir: Path, records: int, batch_size: int) -> dict[str, Any]:
    await upgrade_database(url)
    database = Database(url)
    sink = CaptureSink(
        database, workdir / "spool" / "calls.jsonl", queue_size=records + 1, batch_size=batch_size
    )
    await sink.start()
    burst = [make_record(n) for n in range(records)]
    started = time.perf_counter()
    for record in burst:
        sink.submit(record)
    submitted = time.perf_counter() - started
    await sink.flush(timeout_s=600)
    elapsed = time.perf_counter() - started
    await sink.stop()
    await database.dispose()
    assert sink.stats.written == records, sink.snapshot()
    return {
        "records": records,
        "batch_size": batch_size,
        "submit_us_per_call": submitted / records * 1e6,
        "seconds": elapsed,
        "rows_per_s": records / elapsed,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        sqlite_url = async_database_url(f"sqlite:///{work / 'kaizen.db'}")
        results["sqlite"] = await measure(sqlite_url, work / "s", args.records, args.batch_size)
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
            results["postgresql"] = await measure(url, work / "p", args.records, args.batch_size)
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
