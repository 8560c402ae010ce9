"""The capture log (write-ahead segments) and the sink around it, against a real SQLite file: a record is on
disk before `submit` returns, a kill leaves a log that the next start replays exactly once (a torn last line
included), committed segments are truncated or deleted, and `stop` stores the batch being written."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import pytest

from gateway.capture import CaptureSink, WriteAheadLog
from storage.database import Database
from storage.records import CallRecord
from storage.schema import upgrade_database_sync


def record(n: int, client_id: str | None = None) -> CallRecord:
    return CallRecord(
        id=f"call-{n}",
        client_request_id=client_id,
        episode_id=f"ep-{n}",
        episode_resolved=True,
        model="scripted-1",
        request={"messages": [{"role": "user", "content": f"hello {n}"}]},
        response={"choices": [{"message": {"role": "assistant", "content": "hi"}}]},
        created_at=time.time(),
    )


def lines(path: Path) -> list[bytes]:
    return [line for line in path.read_bytes().splitlines() if line]


@pytest.fixture
def database_path(tmp_path: Path) -> Path:
    path = tmp_path / "kaizen.db"
    upgrade_database_sync(f"sqlite+aiosqlite:///{path}")
    return path


def stored_ids(database_path: Path) -> list[str]:
    with sqlite3.connect(database_path) as connection:
        return sorted(row[0] for row in connection.execute("SELECT id FROM calls"))


def make_sink(tmp_path: Path, database_path: Path, **options: float) -> CaptureSink:
    return CaptureSink(
        Database(f"sqlite+aiosqlite:///{database_path}"),
        tmp_path / "spool" / "calls.jsonl",
        wal_dir=tmp_path / "spool" / "log",
        **options,  # type: ignore[arg-type]
    )


def test_append_is_on_disk_and_settling_truncates_the_active_segment(tmp_path: Path) -> None:
    wal = WriteAheadLog(tmp_path / "log", segment_bytes=1 << 20)
    segments = [wal.append(record(n)) for n in range(3)]
    (path,) = wal.directory.glob("*.jsonl")
    assert len(lines(path)) == 3  # readable by another process without a close or fsync
    wal.settle(segments[:2])
    assert len(lines(path)) == 3 and wal.unsettled == 1
    wal.settle(segments[2:])
    assert path.stat().st_size == 0 and wal.unsettled == 0
    wal.append(record(3))
    assert len(lines(path)) == 1


def test_rotated_segments_are_deleted_once_committed(tmp_path: Path) -> None:
    wal = WriteAheadLog(tmp_path / "log", segment_bytes=4096)
    segments = [wal.append(record(n)) for n in range(40)]
    assert len(set(segments)) > 2
    first = min(segments)
    wal.settle(s for s in segments if s == first)
    on_disk = {int(p.stem) for p in wal.directory.glob("*.jsonl")}
    assert first not in on_disk and on_disk == set(segments) - {first}
    wal.settle(s for s in segments if s != first)
    assert [p.stat().st_size for p in wal.directory.glob("*.jsonl")] in ([], [0])


def test_a_killed_process_log_is_replayed_once_torn_line_skipped(tmp_path: Path, database_path: Path) -> None:
    # What a SIGKILL leaves: whole lines of answered calls, one of them already committed, and a torn write.
    wal = WriteAheadLog(tmp_path / "spool" / "log", segment_bytes=1 << 20)
    for n in range(5):
        wal.append(record(n))
    (path,) = wal.directory.glob("*.jsonl")
    with path.open("ab") as handle:
        handle.write(b'{"id": "call-torn", "episode_')

    async def run() -> None:
        committed = make_sink(tmp_path, database_path)
        await committed._write([record(0)])
        sink = make_sink(tmp_path, database_path)
        await sink.start()  # replays before it returns: the gateway serves only after this
        assert stored_ids(database_path) == [f"call-{n}" for n in range(5)]
        assert sink.stats.recovered == 4
        assert list(sink.wal.directory.glob("*.jsonl")) == []
        await sink.stop()
        again = make_sink(tmp_path, database_path)
        await again.start()
        assert again.stats.recovered == 0
        await again.stop()

    asyncio.run(run())
    assert stored_ids(database_path) == [f"call-{n}" for n in range(5)]


def test_stop_stores_the_batch_being_written(tmp_path: Path, database_path: Path) -> None:
    async def run() -> None:
        sink = make_sink(tmp_path, database_path, flush_ms=1.0)
        await sink.start()
        blocker = sqlite3.connect(database_path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")  # the writer's insert waits on this lock: a batch in progress
        try:
            for n in range(5):
                sink.submit(record(n))
            deadline = time.monotonic() + 5
            while sink.snapshot()["queue_depth"] > 0:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.005)
            for n in range(5, 8):
                sink.submit(record(n))  # queued behind the batch in progress
            stopping = asyncio.create_task(sink.stop())
            for _ in range(5):
                await asyncio.sleep(0)
            assert not stopping.done()
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        await stopping

    asyncio.run(run())
    assert stored_ids(database_path) == [f"call-{n}" for n in range(8)]
    assert [p.stat().st_size for p in (tmp_path / "spool" / "log").glob("*.jsonl")] in ([], [0])


def test_calls_submitted_after_stop_stay_in_the_log(tmp_path: Path, database_path: Path) -> None:
    async def run() -> None:
        sink = make_sink(tmp_path, database_path)
        await sink.start()
        await sink.stop()
        assert sink.closing
        sink.submit(record(1))  # e.g. a response finished past the drain: durable, stored at next start
        after = make_sink(tmp_path, database_path)
        await after.start()
        assert after.stats.recovered == 1
        await after.stop()

    asyncio.run(run())
    assert stored_ids(database_path) == ["call-1"]
