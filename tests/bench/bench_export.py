"""Memory and speed of `kaizen export` as the table grows: streaming keeps the peak flat.

Builds SQLite databases of synthetic captured traffic (one and two-turn conversations of about 1 KiB of text a
turn, a third of them rewarded), one per size, then runs `kaizen export` on each as a user would (a child
process, each format and schema), sampling the child's resident memory every 10 ms. A run on an empty
selection measures what the command costs before it reads anything (interpreter, SQLAlchemy, polars).

    python -m tests.bench.bench_export [--episodes 5000 50000] [--out tests/bench/results/export.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from gateway.settings import async_database_url
from migrations.runner import upgrade_database
from storage.calls import write_calls
from storage.database import Database
from storage.records import CallRecord
from storage.rewards import NewReward, insert_rewards

logger = logging.getLogger("bench_export")
DEFAULT_OUT = Path(__file__).parent / "results" / "export.json"
WORDS = [
    "the",
    "model",
    "learns",
    "on",
    "the",
    "job",
    "from",
    "what",
    "users",
    "say",
    "about",
    "its",
    "replies",
    "and",
    "tools",
]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _records(rng: random.Random, start: int, count: int, now: float) -> list[CallRecord]:
    records = []
    for n in range(start, start + count):
        episode = f"ep-{n:08d}"
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a helpful support agent."},
            {"role": "user", "content": _text(rng, 150)},
        ]
        for turn in range(1 if n % 2 else 2):
            reply = {"content": _text(rng, 100), "refusal": None, "role": "assistant"}
            records.append(
                CallRecord(
                    id=f"{episode}-{turn}",
                    episode_id=episode,
                    episode_resolved=True,
                    policy="bench",
                    model="bench",
                    adapter_version=n % 3,
                    engine_model=f"bench@{n % 3}",
                    request={"messages": list(messages), "tools": None, "tool_choice": None, "params": {}},
                    response={
                        "choices": [{"index": 0, "message": reply, "finish_reason": "stop", "logprobs": None}]
                    },
                    usage={"prompt_tokens": 40 * len(messages), "completion_tokens": 100},
                    latency_ms=20.0,
                    created_at=now + n / 1000 + turn / 10_000,
                )
            )
            messages += [reply, {"role": "user", "content": _text(rng, 30)}]
    return records


async def build_database(path: Path, episodes: int, seed: int = 0) -> None:
    url = async_database_url(f"sqlite:///{path}")
    await upgrade_database(url)
    database = Database(url)
    rng = random.Random(seed)
    now = time.time() - episodes
    try:
        for start in range(0, episodes, 1000):
            batch = _records(rng, start, min(1000, episodes - start), now)
            async with database.session() as session:
                await write_calls(session, batch)
            rewarded = sorted({r.episode_id for r in batch if int(r.episode_id[3:]) % 3 == 0})
            async with database.session() as session:
                await insert_rewards(
                    session, [NewReward(source="feedback", value=1.0, episode_id=e) for e in rewarded]
                )
                await session.commit()
    finally:
        await database.dispose()


def _peak_rss(command: Sequence[str], env: dict[str, str]) -> tuple[int, float, str]:
    """Run a command; (peak resident bytes, wall seconds, stdout), sampling every 10 ms."""
    started = time.perf_counter()
    process = subprocess.Popen(list(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    watched = psutil.Process(process.pid)
    peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            try:
                peak = max(peak, watched.memory_info().rss)
            except psutil.NoSuchProcess:
                return
            done.wait(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = process.communicate()
    done.set()
    sampler.join()
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited with {process.returncode}")
    return peak, time.perf_counter() - started, out.decode()


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    kaizen = str(Path(sys.executable).with_name("kaizen"))
    with tempfile.TemporaryDirectory(prefix="kaizen-bench-export-") as tmp:
        root = Path(tmp)
        for episodes in args.episodes:
            db = root / f"db-{episodes}.db"
            started = time.perf_counter()
            asyncio.run(build_database(db, episodes))
            logger.info(
                "built %d episodes (%.0f MiB) in %.0f s",
                episodes,
                db.stat().st_size / 2**20,
                time.perf_counter() - started,
            )
            env = {
                **os.environ,
                "KAIZEN_DATABASE_URL": f"sqlite:///{db}",
                "KAIZEN_DATA_DIR": str(root / "data"),
            }
            cases = [
                ("parquet", "kaizen", []),
                ("jsonl", "kaizen", []),
                ("parquet", "openai", []),
                ("parquet", "kaizen", ["--policy", "nobody"]),
            ]
            for fmt, schema, extra in cases:
                out = root / f"out-{episodes}.{fmt}"
                command = [kaizen, "export", str(out), "--schema", schema, *extra]
                peak, wall, stdout = _peak_rss(command, env)
                report = json.loads(stdout.strip().splitlines()[-1])
                row = {
                    "episodes_in_table": episodes,
                    "database_mib": round(db.stat().st_size / 2**20, 1),
                    "format": fmt,
                    "schema": schema,
                    "selection": "none (start-up cost)" if extra else "all",
                    "exported": report["episodes"],
                    "file_mib": round(report["bytes"] / 2**20, 2),
                    "peak_rss_mib": round(peak / 2**20, 1),
                    "wall_s": round(wall, 2),
                    "episodes_per_s": round(report["episodes"] / wall) if report["episodes"] else None,
                }
                logger.info("%s", row)
                results.append(row)
                out.unlink(missing_ok=True)
    return {
        "benchmark": "kaizen export memory",
        "settings": {"episodes": args.episodes, "batch_size": 500},
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        },
        "unix_time": int(time.time()),
        "runs": results,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--episodes", type=int, nargs="+", default=[5000, 50000], help="table sizes to compare"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    logger.info("results written to %s", args.out)


if __name__ == "__main__":
    main()
