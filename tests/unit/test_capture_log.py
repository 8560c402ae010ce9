"""The capture log and its writer process, against a real SQLite file: a record is on disk before `submit`
returns, the writer follows the segments as they grow and rotate, a kill leaves a log that the next start
replays exactly once (a torn last line included), stored segments are deleted, `stop` stores the batch being
written, and a writer that dies or a log that cannot be written loses nothing."""

from __future__ import annotations

import asyncio
import errno
import io
import logging
import os
import signal
import sqlite3
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import pytest

from gateway.capture.sink import CaptureSink, WriteAheadLog
from gateway.capture.writer import (
    CaptureWriter,
    Channel,
    LogTail,
    WriterConfig,
    segment_numbers,
    segment_path,
)
from migrations.runner import upgrade_database_sync
from storage.calls import write_calls
from storage.database import Database
from storage.records import CallRecord
from tests.support.polling import wait_until_async
from tests.support.ports import free_port


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
    with sqlite3.connect(path) as connection:  # as the gateway's first connection leaves it
        connection.execute("PRAGMA journal_mode=WAL")
    return path


def stored_ids(database_path: Path) -> list[str]:
    with sqlite3.connect(database_path) as connection:
        return sorted(row[0] for row in connection.execute("SELECT id FROM calls"))


def make_sink(tmp_path: Path, database_path: Path, **options: float) -> CaptureSink:
    return CaptureSink(
        f"sqlite+aiosqlite:///{database_path}",
        tmp_path / "spool" / "log",
        **options,  # type: ignore[arg-type]
    )


def test_append_is_on_disk_and_rotation_starts_the_next_segment(tmp_path: Path) -> None:
    wal = WriteAheadLog(tmp_path / "log", segment_bytes=1 << 20)
    assert wal.open() == 0
    for n in range(3):
        wal.append(record(n))
    assert len(lines(segment_path(wal.directory, 0))) == 3  # readable by another process, no close or fsync
    wal.rotate()
    assert segment_numbers(wal.directory) == [0, 1]  # the next exists at once: the writer knows 0 is complete
    wal.append(record(3))
    assert len(lines(segment_path(wal.directory, 1))) == 1
    wal.close()
    wal.close()
    assert segment_numbers(wal.directory) == [0, 1]
    again = WriteAheadLog(wal.directory, segment_bytes=1 << 20)
    assert again.open() == 2  # after what an earlier process left
    again.close()
    assert segment_numbers(wal.directory) == [0, 1]  # an empty segment is not left behind


def test_segments_rotate_at_their_size(tmp_path: Path) -> None:
    wal = WriteAheadLog(tmp_path / "log", segment_bytes=4096)
    wal.open()
    for n in range(40):
        wal.append(record(n))
    found = segment_numbers(wal.directory)
    assert len(found) > 2
    assert sum(len(lines(segment_path(wal.directory, s))) for s in found) == 40


def test_the_tail_follows_a_growing_segment_and_skips_a_torn_line(tmp_path: Path) -> None:
    directory = tmp_path / "log"
    directory.mkdir()
    segment_path(directory, 3).write_bytes(b'{"a": 1}\n{"a": 2}\n{"torn')  # left by a killed process
    live = segment_path(directory, 4)
    live.write_bytes(b'{"b": 1}\n{"b"')
    tail = LogTail(directory, live_from=4)
    got = tail.read(100)
    assert [line for line, _ in got] == [b'{"a": 1}', b'{"a": 2}', b'{"b": 1}']
    assert [start for _, start in got] == [(3, 0), (3, 9), (4, 0)]
    assert tail.caught_up and tail.position == (4, 9)  # a partial line of the live segment waits
    with live.open("ab") as handle:
        handle.write(b': 2}\n{"b": 3}\n')
    assert [line for line, _ in tail.read(100)] == [b'{"b": 2}', b'{"b": 3}']
    segment_path(directory, 5).write_bytes(b'{"c": 1}\n')  # 4 is complete once 5 exists
    assert [(line, start) for line, start in tail.read(100)] == [(b'{"c": 1}', (5, 0))]
    tail.seek((3, 9))  # read again from a position (a replay after the database was down)
    assert [line for line, _ in tail.read(2)][:2] == [b'{"a": 2}', b'{"b": 1}']


def test_a_killed_process_log_is_replayed_once_torn_line_skipped(tmp_path: Path, database_path: Path) -> None:
    # What a SIGKILL leaves: whole lines of answered calls, one of them already committed, and a torn write.
    wal = WriteAheadLog(tmp_path / "spool" / "log", segment_bytes=1 << 20)
    wal.open()
    for n in range(5):
        wal.append(record(n))
    with segment_path(wal.directory, 0).open("ab") as handle:
        handle.write(b'{"id": "call-torn", "episode_')

    async def run() -> None:
        database = Database(f"sqlite+aiosqlite:///{database_path}")
        async with database.session() as session:
            await write_calls(session, [record(0)])
        await database.dispose()
        sink = make_sink(tmp_path, database_path)
        await sink.start()  # replays before it returns: the gateway serves only after this
        assert stored_ids(database_path) == [f"call-{n}" for n in range(5)]
        assert sink.snapshot()["recovered"] == 4
        await sink.stop()
        assert segment_numbers(wal.directory) == []
        again = make_sink(tmp_path, database_path)
        await again.start()
        assert again.snapshot()["recovered"] == 0
        await again.stop()

    asyncio.run(run())
    assert stored_ids(database_path) == [f"call-{n}" for n in range(5)]


def test_stored_segments_are_deleted(tmp_path: Path, database_path: Path) -> None:
    async def run() -> None:
        sink = make_sink(tmp_path, database_path, flush_ms=1.0)
        await sink.start()
        for n in range(3):
            sink.submit(record(n))
        first = sink.wal.segment
        sink.wal.rotate()  # what the once-a-second tick does

        async def deleted() -> bool:
            return first not in segment_numbers(sink.wal.directory)

        async def settled() -> bool:  # the writer's status reaches the sink after it deletes the segment
            return bool(sink.snapshot()["log_unsettled"] == 0)

        await wait_until_async(deleted, "the stored segment to be deleted", timeout_s=30)
        assert stored_ids(database_path) == ["call-0", "call-1", "call-2"]
        await wait_until_async(settled, "the sink to count the three calls as settled", timeout_s=30)
        await sink.stop()

    asyncio.run(run())


def test_stop_stores_the_batch_being_written(tmp_path: Path, database_path: Path) -> None:
    async def run() -> None:
        sink = make_sink(tmp_path, database_path, flush_ms=1.0)
        await sink.start()
        blocker = sqlite3.connect(database_path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")  # the writer's insert waits on this lock: a batch in progress
        try:
            for n in range(5):
                sink.submit(record(n))

            async def writing() -> bool:
                return sink.snapshot()["writing"] > 0

            await wait_until_async(writing, "the writer to block on the lock with a batch", timeout_s=30)
            for n in range(5, 8):
                sink.submit(record(n))  # behind the batch in progress
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
    assert segment_numbers(tmp_path / "spool" / "log") == []


def test_calls_submitted_after_stop_stay_in_the_log(tmp_path: Path, database_path: Path) -> None:
    async def run() -> None:
        sink = make_sink(tmp_path, database_path)
        await sink.start()
        await sink.stop()
        assert sink.closing
        sink.submit(record(1))  # e.g. a response finished past the drain: durable, stored at next start
        after = make_sink(tmp_path, database_path)
        await after.start()
        assert after.snapshot()["recovered"] == 1
        await after.stop()

    asyncio.run(run())
    assert stored_ids(database_path) == ["call-1"]


def test_a_killed_writer_is_restarted_and_loses_nothing(tmp_path: Path, database_path: Path) -> None:
    async def run() -> None:
        sink = make_sink(tmp_path, database_path, flush_ms=1.0, retry_s=0.05)
        await sink.start()
        for n in range(50):
            sink.submit(record(n))
        assert sink._process is not None
        sink._process.kill()
        for n in range(50, 100):
            sink.submit(record(n))  # while the writer is dead or starting again
        await sink.flush(timeout_s=60)
        counters = sink.snapshot()
        assert counters["writer_restarts"] == 1 and counters["dropped"] == 0
        await sink.stop()

    asyncio.run(run())
    assert stored_ids(database_path) == sorted(f"call-{n}" for n in range(100))


def test_a_call_the_log_cannot_take_still_reaches_the_database(tmp_path: Path, database_path: Path) -> None:
    async def run() -> None:
        sink = make_sink(tmp_path, database_path, flush_ms=1.0)
        await sink.start()

        def disk_full(_: CallRecord) -> None:
            raise OSError(28, "No space left on device")

        sink.wal.append = disk_full  # type: ignore[method-assign]
        sink.submit(record(1))
        await sink.flush(timeout_s=30)
        counters = sink.snapshot()
        assert counters["log_failures"] == 1 and counters["written"] == 1 and counters["dropped"] == 0
        await sink.stop()

    asyncio.run(run())
    assert stored_ids(database_path) == ["call-1"]


def test_a_spool_file_of_an_earlier_version_is_stored(tmp_path: Path, database_path: Path) -> None:
    spool = (
        tmp_path / "spool" / "calls.jsonl"
    )  # where calls waited for the database before the log was the spool
    spool.parent.mkdir(parents=True)
    spool.write_bytes(b"".join(msgspec.json.encode(record(n)) + b"\n" for n in range(3)))

    async def run() -> None:
        sink = make_sink(tmp_path, database_path)
        await sink.start()
        assert sink.snapshot()["recovered"] == 3
        await sink.stop()

    asyncio.run(run())
    assert stored_ids(database_path) == ["call-0", "call-1", "call-2"]
    assert not spool.exists() and segment_numbers(tmp_path / "spool" / "log") == []


def test_a_drain_past_its_timeout_leaves_the_rest_for_the_next_start(
    tmp_path: Path, database_path: Path
) -> None:
    async def run() -> None:
        # Nothing listens on this port: the database is unreachable through the whole drain.
        unreachable = f"postgresql+asyncpg://kaizen@127.0.0.1:{free_port()}/kaizen"
        sink = CaptureSink(unreachable, tmp_path / "spool" / "log", flush_ms=1.0, drain_timeout_s=0.5)
        await sink.start()
        for n in range(4):
            sink.submit(record(n))
        await sink.stop()
        assert sink.snapshot()["spooled"] == 4
        assert segment_numbers(tmp_path / "spool" / "log") != []  # the calls wait in the log
        after = make_sink(tmp_path, database_path)
        await after.start()
        assert after.snapshot()["recovered"] == 4
        await after.stop()

    asyncio.run(run())
    assert stored_ids(database_path) == [f"call-{n}" for n in range(4)]


def test_calls_wait_in_the_log_while_the_database_is_down_and_are_counted_once(
    tmp_path: Path, database_path: Path
) -> None:
    wal = WriteAheadLog(tmp_path / "log", segment_bytes=1 << 20)
    live = wal.open()
    wal.append(record(0))
    with segment_path(wal.directory, live).open("ab") as handle:
        handle.write(b'{"not": "a call"}\n')  # dropped once, however often the log is read again
    wal.append(record(1))

    async def run() -> None:
        unreachable = Database(f"postgresql+asyncpg://kaizen@127.0.0.1:{free_port()}/kaizen")
        config = WriterConfig(
            database_url="",
            log_dir=str(wal.directory),
            live_from=live,
            batch_size=500,
            flush_ms=1.0,
            retry_s=0.05,
            drain_timeout_s=30.0,
            log_level=logging.WARNING,
        )
        writer = CaptureWriter(config, Channel(io.BytesIO()), unreachable)
        running = asyncio.create_task(writer.run())

        def counted(spooled: int) -> Callable[[], Awaitable[bool]]:
            async def check() -> bool:
                return writer.status.spooled == spooled and not writer.status.database_up

            return check

        await wait_until_async(counted(2), "the two calls held for the database", timeout_s=30)
        wal.append(record(2))  # answered during the outage: counted by reading ahead
        await wait_until_async(counted(3), "the call answered during the outage", timeout_s=30)
        writer.database = Database(f"sqlite+aiosqlite:///{database_path}")  # the database answers again

        async def replayed() -> bool:
            return writer.status.replayed == 3

        await wait_until_async(replayed, "the held calls to be stored", timeout_s=30)
        status = writer.status
        assert (status.spooled, status.replayed, status.written, status.dropped) == (3, 3, 0, 1)
        assert (status.held, status.spool_bytes, status.settled, status.database_up) == (0, 0, 4, True)
        writer.orphaned = True
        await running
        await unreachable.dispose()
        await writer.database.dispose()

    asyncio.run(run())
    assert stored_ids(database_path) == ["call-0", "call-1", "call-2"]


def test_the_writer_reports_the_final_episode_of_provisionally_stitched_calls(
    tmp_path: Path, database_path: Path
) -> None:
    """A follow-up the gateway could not stitch from memory is linked by the writer; the gateway hears which
    episode each provisional call ended in (it settles its stitch cache with that), and nothing of final ones."""
    first = msgspec.structs.replace(record(1), episode_resolved=False, stitch_keys=["tail-1"])
    follow_up = msgspec.structs.replace(
        record(2), episode_resolved=False, stitch_lookup=["tail-1"], stitch_keys=["tail-2"]
    )
    final = msgspec.structs.replace(record(3), stitch_keys=["tail-3"])
    reported: list[tuple[str, str]] = []

    async def run() -> None:
        sink = make_sink(tmp_path, database_path, flush_ms=5.0, stitch_grace_ms=1000.0)
        sink.on_stored = reported.extend
        await sink.start()
        for item in (first, follow_up, final):
            sink.submit(item)

        async def both_reported() -> bool:
            return len(reported) >= 2

        await wait_until_async(both_reported, "the writer to report both provisional calls")
        await sink.stop()

    asyncio.run(run())
    assert sorted(reported) == [("call-1", "ep-1"), ("call-2", "ep-1")]
    assert stored_ids(database_path) == ["call-1", "call-2", "call-3"]


def test_the_writer_runs_the_code_its_gateway_was_imported_from() -> None:
    """The writer's path starts with the directory that holds the `gateway` package, so it runs this very code
    whatever the working directory and the installed version are (once, after the capture modules moved into
    `gateway/capture/`, it named `gateway/` itself, where no `gateway` package is)."""
    from trainer.control.child_processes import PACKAGE_ROOT

    root = Path(PACKAGE_ROOT)
    assert (root / "gateway" / "capture" / "writer.py").is_file()


def fill_disk(sink: CaptureSink) -> None:
    """The capture log's file system refuses writes: the log's appends and the sink's probe writes fail as on a
    full disk. (tests/integration/test_capture_disk_full.py has the kernel refuse them, under a real gateway.)"""

    def refuse(*_: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    sink.wal.append = refuse  # type: ignore[method-assign]
    sink.wal.probe = refuse  # type: ignore[method-assign]
    sink.wal.rotate = refuse  # type: ignore[method-assign]


def free_disk(sink: CaptureSink) -> None:
    for name in ("append", "probe", "rotate"):
        vars(sink.wal).pop(name)


def line_bytes(call: CallRecord) -> int:
    return len(msgspec.json.encode(call)) + 1


def test_calls_held_in_memory_are_capped_reported_and_stored_once_the_log_is_back(
    tmp_path: Path, database_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("gateway.capture.sink._OUTAGE_REPORT_S", 0.0)  # report on every retry, not every 30 s
    calls = [record(n) for n in range(8)]
    sizes = [line_bytes(call) for call in calls]
    limit = sum(sizes[:5]) + min(sizes) - 1  # room for the first five, not for a sixth

    async def run() -> None:
        sink = make_sink(tmp_path, database_path, flush_ms=1.0, memory_limit_bytes=limit)
        await sink.start()
        await sink.flush()
        assert sink._process is not None
        writer = sink._process.pid
        os.kill(writer, signal.SIGSTOP)  # what it is sent stays in memory until it goes on
        fill_disk(sink)
        try:
            assert all(sink.submit(call) for call in calls)  # answered, all of them
            counters = sink.snapshot()
            assert (sink.state, counters["durable"], counters["log_failures"]) == ("memory", False, 8)
            assert (counters["memory_calls"], counters["memory_bytes"]) == (5, sum(sizes[:5]))
            assert (counters["dropped"], counters["queued"]) == (3, 8)

            async def reported() -> bool:
                return any("still cannot be written" in r.getMessage() for r in caplog.records)

            await wait_until_async(reported, "the error line repeated while it lasts")
        finally:
            os.kill(writer, signal.SIGCONT)
        await sink.flush()
        assert (sink.memory_calls, sink.memory_bytes) == (0, 0)
        free_disk(sink)

        async def back() -> bool:
            return sink.state == "log"

        await wait_until_async(back, "the sink to go back to the log")
        assert sink.submit(record(8))
        assert sink.snapshot()["log_failures"] == 8
        await sink.stop()

    with caplog.at_level(logging.INFO, logger="gateway.capture.sink"):
        asyncio.run(run())
    assert stored_ids(database_path) == [f"call-{n}" for n in (0, 1, 2, 3, 4, 8)]
    messages = [r.getMessage() for r in caplog.records]
    assert sum("the capture log cannot be written" in m for m in messages) == 1
    assert sum("can be written again" in m and "3 dropped" in m for m in messages) == 1


def test_calls_held_only_in_memory_are_counted_lost_when_the_writer_dies(
    tmp_path: Path, database_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def run() -> None:
        sink = make_sink(tmp_path, database_path, flush_ms=1.0, retry_s=0.05)
        await sink.start()
        await sink.flush()
        assert sink._process is not None
        writer = sink._process
        os.kill(writer.pid, signal.SIGSTOP)
        fill_disk(sink)
        for n in range(3):
            sink.submit(record(n))
        assert sink.memory_calls == 3
        writer.kill()

        async def restarted() -> bool:  # also when the log cannot start the new writer's segment
            return sink._process is not writer and sink.writer.ready

        await wait_until_async(restarted, "the writer restarted")
        assert sink.snapshot()["writer_restarts"] == 1
        counters = sink.snapshot()
        assert (counters["dropped"], counters["memory_calls"], counters["memory_bytes"]) == (3, 0, 0)
        free_disk(sink)
        await sink.stop()

    asyncio.run(run())
    assert stored_ids(database_path) == []
    assert any("3 captured calls held only in memory were lost" in r.getMessage() for r in caplog.records)


def test_strict_capture_refuses_answered_calls_the_log_cannot_take(
    tmp_path: Path, database_path: Path
) -> None:
    async def run() -> None:
        sink = make_sink(tmp_path, database_path, flush_ms=1.0, require_durable=True)
        await sink.start()
        assert sink.submit(record(0)) and not sink.refusing
        fill_disk(sink)
        assert not sink.submit(record(1))  # answered: the caller refuses it, nothing is kept
        assert sink.refusing and sink.state == "refusing"
        failed = msgspec.structs.replace(record(2), status="error")
        assert sink.submit(failed)  # not answered anyway: kept in memory, as without strict mode
        counters = sink.snapshot()
        assert (counters["refused"], counters["log_failures"], counters["queued"]) == (1, 1, 2)
        free_disk(sink)

        async def back() -> bool:
            return not sink.refusing and sink.state == "log"

        await wait_until_async(back, "the sink to take calls again")
        assert sink.submit(record(3))
        await sink.stop()

    asyncio.run(run())
    assert stored_ids(database_path) == ["call-0", "call-2", "call-3"]


def test_the_probe_leaves_nothing_beside_the_segments(tmp_path: Path) -> None:
    wal = WriteAheadLog(tmp_path / "log", segment_bytes=1 << 20)
    wal.open()
    wal.probe()
    assert sorted(p.name for p in wal.directory.iterdir()) == [segment_path(wal.directory, 0).name]
