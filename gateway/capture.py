"""Capture: every answered call is durable before its answer goes out, and reaches SQL without the request
waiting on the database.

`CaptureSink.submit` appends the record to a write-ahead log (JSON lines, one `write()` to the OS per call, so a
process kill loses nothing; fsync is batched on a timer, which bounds what a power loss can take) and to a
bounded in-memory queue. One writer task inserts batches from the queue and then settles their log segments: a
segment is truncated or deleted once every record in it is committed. At start-up, segments left by a killed
process are replayed before the gateway serves. When the database fails, batches go to an append-only spool
file (JSON lines) and are replayed in order once it answers again; while the spool holds anything, new batches
are appended behind it so order is kept. Writes are idempotent by the server-generated call id, so a replayed
record is stored once. Every path is counted; every loss is logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

import msgspec
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from gateway.capture_directory import CaptureDirectory
from storage.calls import resolve_stitched_episodes, write_calls
from storage.database import Database
from storage.records import CallRecord

log = logging.getLogger(__name__)

T = TypeVar("T")

# How long the storing thread may wait for the interpreter lock once its I/O is done (CPython's default is 5 ms).
_SWITCH_INTERVAL_S = 0.0005

_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (OperationalError, PoolTimeout, OSError, TimeoutError)


@dataclass
class CaptureStats:
    queued: int = 0  # accepted into the in-memory queue
    written: int = 0  # inserted into the database straight from the queue
    spooled: int = 0  # appended to the spool file (database down, or queue full)
    replayed: int = 0  # moved from the spool file into the database
    recovered: int = 0  # read back from the write-ahead log at start-up (left by a killed process)
    dropped: int = 0  # lost: could be neither written nor spooled, or rejected by the database as invalid
    log_failures: int = 0  # could not be appended to the write-ahead log (not durable until written)
    opted_out: int = 0  # served with `X-Kaizen-No-Log: true`, nothing stored


def _read_records(path: Path, decoder: msgspec.json.Decoder[CallRecord]) -> Iterator[CallRecord]:
    """Records of a JSON-lines file; a torn line (a kill in the middle of a write) is skipped and logged."""
    with path.open("rb") as handle:
        for line in handle:
            if not line.strip():
                continue
            try:
                yield decoder.decode(line)
            except msgspec.DecodeError:
                log.error("skipping a torn line in %s (a crash mid-write)", path)


def _batches(records: Iterable[CallRecord], size: int) -> Iterator[list[CallRecord]]:
    batch: list[CallRecord] = []
    for record in records:
        batch.append(record)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


class WriteAheadLog:
    """Numbered JSON-lines segments (`<n>.jsonl`) holding every captured call until it is committed.

    `append` is one buffered write plus a flush: the line is in the OS once it returns, which survives a kill of
    the process. Each segment counts its uncommitted records; `settle` truncates the active segment, or deletes a
    rotated one, when that count reaches zero. All of this runs on the event loop, so no lock is needed.
    """

    def __init__(self, directory: Path, segment_bytes: int) -> None:
        self.directory = directory
        self.segment_bytes = segment_bytes
        self._encoder = msgspec.json.Encoder()
        self._file: IO[bytes] | None = None
        self._segment = 0
        self._size = 0
        self._open: dict[int, int] = {}  # segment -> records appended and not yet settled
        self._dirty = False

    def _path(self, segment: int) -> Path:
        return self.directory / f"{segment:012d}.jsonl"

    def leftovers(self) -> list[Path]:
        """Segments left on disk by an earlier process, oldest first; new appends go to a later segment."""
        if not self.directory.is_dir():
            return []
        found = sorted(p for p in self.directory.glob("*.jsonl") if p.stem.isdigit())
        if found:
            self._segment = max(self._segment, int(found[-1].stem) + 1)
        return found

    def append(self, record: CallRecord) -> int:
        """Append one record; returns its segment number (handed back to `settle` once it is committed)."""
        if self._file is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._file = self._path(self._segment).open("ab")
            self._size = self._file.tell()
        line = self._encoder.encode(record) + b"\n"
        self._file.write(line)
        self._file.flush()
        segment = self._segment
        self._open[segment] = self._open.get(segment, 0) + 1
        self._size += len(line)
        self._dirty = True
        if self._size >= self.segment_bytes:
            self._rotate()
        return segment

    def settle(self, segments: Iterable[int]) -> None:
        """These records are committed (or spooled): release segments that hold nothing else."""
        for segment in segments:
            left = self._open[segment] - 1
            if left:
                self._open[segment] = left
                continue
            del self._open[segment]
            if segment == self._segment and self._file is not None:
                self._file.seek(0)
                self._file.truncate()
                self._size = 0
            else:
                self._path(segment).unlink(missing_ok=True)

    @property
    def unsettled(self) -> int:
        return sum(self._open.values())

    def size_bytes(self) -> int:
        if not self.directory.is_dir():
            return 0
        return sum(p.stat().st_size for p in self.directory.glob("*.jsonl"))

    async def sync(self) -> None:
        """fsync the active segment off the event loop (power-loss durability; a kill needs no fsync)."""
        if not self._dirty or self._file is None:
            return
        self._dirty = False
        handle = os.dup(self._file.fileno())  # the file may be rotated or closed while the thread syncs
        try:
            await asyncio.to_thread(os.fsync, handle)
        finally:
            os.close(handle)

    def _rotate(self) -> None:
        assert self._file is not None
        self._file.close()
        self._file = None
        if self._segment not in self._open:
            self._path(self._segment).unlink(missing_ok=True)
        self._segment += 1
        self._size = 0

    def close(self) -> None:
        """Close the active segment; what is still unsettled stays on disk for the next start."""
        if self._file is None:
            return
        self._file.close()
        self._file = None
        if self._segment not in self._open:
            self._path(self._segment).unlink(missing_ok=True)
        else:
            self._segment += 1


class Spool:
    """Append-only JSON-lines file of records waiting for a database that is down."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[bytes] | None = None
        self._encoder = msgspec.json.Encoder()
        self._decoder = msgspec.json.Decoder(CallRecord)

    def append(self, records: list[CallRecord]) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("ab")
        self._file.write(b"".join(self._encoder.encode(r) + b"\n" for r in records))
        self._file.flush()

    @property
    def pending(self) -> bool:
        return self.path.exists() and self.path.stat().st_size > 0

    def size_bytes(self) -> int:
        return self.path.stat().st_size if self.path.exists() else 0

    def read_batches(self, batch_size: int) -> list[list[CallRecord]]:
        return list(_batches(_read_records(self.path, self._decoder), batch_size))

    def clear(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class RecentTargets:
    """Ids of recently submitted calls and their episodes (bounded), so feedback that arrives before the
    writer stores its target (still queued, or in the spool) is recognised and accepted. Client request ids
    map to the newest call that carried them."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._calls: OrderedDict[str, tuple[str, str | None]] = OrderedDict()
        self._episodes: OrderedDict[str, str | None] = OrderedDict()
        self._clients: OrderedDict[str, str] = OrderedDict()

    def remember(self, record: CallRecord) -> None:
        self._calls[record.id] = (record.episode_id, record.policy)
        self._episodes[record.episode_id] = record.policy
        self._episodes.move_to_end(record.episode_id)
        if record.client_request_id is not None:
            self._clients[record.client_request_id] = record.id
            self._clients.move_to_end(record.client_request_id)
        for items in (self._calls, self._episodes, self._clients):
            while len(items) > self.size:
                items.popitem(last=False)

    def call(self, call_id: str) -> tuple[str, str | None] | None:
        """(episode id, policy) of a recent call; the episode may still change if the writer stitches it."""
        return self._calls.get(call_id)

    def newest(self, client_request_id: str) -> str | None:
        """Server id of the newest recent call that carried this client request id."""
        return self._clients.get(client_request_id)

    def episode(self, episode_id: str) -> tuple[bool, str | None]:
        """(known, policy) of a recent episode."""
        return (episode_id in self._episodes, self._episodes.get(episode_id))


class CaptureSink:
    """The write-ahead log, the bounded queue, its writer task and the spool."""

    def __init__(
        self,
        database: Database,
        spool_path: Path,
        *,
        wal_dir: Path | None = None,
        queue_size: int = 50_000,
        batch_size: int = 500,
        flush_ms: float = 50.0,
        retry_s: float = 1.0,
        fsync_ms: float = 1000.0,
        segment_bytes: int = 16 * 2**20,
        drain_timeout_s: float = 30.0,
        stitch_grace_ms: float = 0.0,
    ) -> None:
        self.database = database
        self.spool = Spool(spool_path)
        self.wal = WriteAheadLog(wal_dir or spool_path.parent / "log", segment_bytes)
        self.stats = CaptureStats()
        self.batch_size = batch_size
        self.flush_s = flush_ms / 1000
        self.retry_s = retry_s
        self.fsync_s = fsync_ms / 1000
        self.drain_timeout_s = drain_timeout_s
        self.stitch_grace_s = stitch_grace_ms / 1000
        # Told about every batch once it is stored (the chat service settles its provisional stitch entries).
        self.on_stored: Callable[[list[CallRecord]], None] | None = None
        self.database_up = True
        self.queue_size = queue_size
        # (record, log segment, monotonic time it was submitted): the oldest one's age decides when to write.
        self._queue: deque[tuple[CallRecord, int, float]] = deque()
        # Follow-ups whose earlier turn is not in the database yet, retried with the next batches (`_hold_back`).
        self._held: list[tuple[CallRecord, int, float]] = []
        self._wake = asyncio.Event()  # the queue went from empty to non-empty, or the sink is stopping
        self._full = asyncio.Event()  # a whole batch is waiting, or the sink is stopping
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._sync_task: asyncio.Task[None] | None = None
        self._next_replay = 0.0
        self._unsettled = 0  # submitted records not yet in the database or the spool
        self.recent = RecentTargets(max(queue_size, 100_000))
        self._store_loop: asyncio.AbstractEventLoop | None = None
        self._store_thread: threading.Thread | None = None
        self._store_database: Database | None = None
        self._switch_interval_s: float | None = None  # the process's own, restored when the thread stops
        self._directory: CaptureDirectory | None = None

    # ------------------------------------------------------------------ request path
    def submit(self, record: CallRecord) -> None:
        """Make a record durable and hand it to the writer. Never blocks and never raises into the request:
        call it before the answer's last byte is sent."""
        self.recent.remember(record)
        try:
            segment = self.wal.append(record)
        except OSError:
            self.stats.log_failures += 1
            if self.stats.log_failures == 1 or self.stats.log_failures % 1000 == 0:
                log.exception(
                    "could not append to the capture log (%d calls so far): they are kept in memory only",
                    self.stats.log_failures,
                )
            segment = -1
        if len(self._queue) >= self.queue_size:
            self._spool([record])
            self._settle([segment])
            return
        self._queue.append((record, segment, time.monotonic()))
        self.stats.queued += 1
        self._unsettled += 1
        self._wake.set()
        if len(self._queue) >= self.batch_size:
            self._full.set()

    @property
    def closing(self) -> bool:
        """Shutdown has begun: new calls are refused (anything submitted anyway is still logged)."""
        return self._closing

    def opt_out(self) -> None:
        self.stats.opted_out += 1

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Replay what a killed process left in the log (before serving), then start the writer."""
        self._claim_directory()
        self._start_store_thread()
        await self._recover()
        self._task = asyncio.create_task(self._run(), name="capture-writer")
        if self.fsync_s > 0:
            self._sync_task = asyncio.create_task(self._sync_loop(), name="capture-fsync")

    async def stop(self) -> None:
        """Write everything submitted, the batch in progress included, then stop (serving has ended by now).

        Past `drain_timeout_s` the writer is cancelled; what it had not committed stays in the log and is
        replayed at the next start.
        """
        self._closing = True
        self._wake.set()
        self._full.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), self.drain_timeout_s)
            except TimeoutError:
                log.warning(
                    "capture drain took over %g s: %d calls stay in the log for the next start",
                    self.drain_timeout_s,
                    self.wal.unsettled,
                )
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
            self._task = None
        if self._sync_task is not None:
            self._sync_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sync_task
            self._sync_task = None
        if self.spool.pending:  # one last try: the database may be back (the spool is replayed at start too)
            await self._replay()
        with contextlib.suppress(OSError):
            await self.wal.sync()
        self.wal.close()
        self.spool.close()
        await self._stop_store_thread()
        if self._directory is not None:
            self._directory.release()
            self._directory = None

    def _claim_directory(self) -> None:
        """Take a capture directory no other live process uses (replicas may share the data directory)."""
        root = self.spool.path.parent
        self._directory = CaptureDirectory.claim(root)
        if self._directory.path == root:
            return
        if self.wal.directory == root / "log":
            self.wal = WriteAheadLog(self._directory.path / "log", self.wal.segment_bytes)
        self.spool = Spool(self._directory.path / self.spool.path.name)

    # ------------------------------------------------------------------ the storing thread
    def _start_store_thread(self) -> None:
        """SQL writes run on their own event loop in their own thread, with their own connections.

        On the serving loop every await of the writer waited behind every in-flight request: under load a batch
        of ~350 rows took ~900 ms there (measured, SQLite, c32), and the backlog grew past the flush window.
        """
        # After each of a batch's ~10 round trips the thread needs the interpreter lock back, and while the serving
        # thread is busy it waited up to the switch interval each time: 50-75 ms per batch under load (c32,
        # 2 cores), most of the capture backlog. A shorter interval only costs while both threads want to run.
        self._switch_interval_s = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval_s, _SWITCH_INTERVAL_S))
        loop = asyncio.new_event_loop()
        self._store_loop = loop
        self._store_database = Database(self.database.url)
        self._store_thread = threading.Thread(target=loop.run_forever, name="capture-store", daemon=True)
        self._store_thread.start()

    async def _stop_store_thread(self) -> None:
        loop, thread, database = self._store_loop, self._store_thread, self._store_database
        if loop is None or thread is None or database is None:
            return
        with contextlib.suppress(Exception):
            await self._on_store_loop(database.dispose())
        loop.call_soon_threadsafe(loop.stop)
        await asyncio.to_thread(thread.join)
        loop.close()
        self._store_loop = self._store_thread = self._store_database = None
        if self._switch_interval_s is not None:
            sys.setswitchinterval(self._switch_interval_s)
            self._switch_interval_s = None

    async def _on_store_loop(self, coroutine: Coroutine[Any, Any, T]) -> T:
        assert self._store_loop is not None
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self._store_loop))

    async def _store(self, records: list[CallRecord]) -> int:
        """write_calls in one transaction, on the storing thread's loop and connections once started."""

        async def store(database: Database) -> int:
            async with database.session() as session:
                return await write_calls(session, records)

        if self._store_database is None:  # not started: tests that drive the writer directly
            return await store(self.database)
        return await self._on_store_loop(store(self._store_database))

    @property
    def settling(self) -> bool:
        """Something submitted is not yet in the database: queued, being written, or in the spool."""
        return self._unsettled > 0 or self.spool.pending

    async def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until everything submitted so far is in the database or the spool (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._unsettled > 0 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)

    # ------------------------------------------------------------------ writer
    async def _recover(self) -> None:
        decoder = msgspec.json.Decoder(CallRecord)
        for path in self.wal.leftovers():
            count = 0
            for batch in _batches(_read_records(path, decoder), self.batch_size):
                count += len(batch)
                for record in batch:
                    self.recent.remember(record)
                await self._write_or_spool(batch, counter="recovered")
            path.unlink()
            if count:
                log.info("recovered %d captured calls from %s (left by an earlier process)", count, path.name)

    async def _run(self) -> None:
        while True:
            if not self._queue:
                if self._closing and not self._held:
                    return
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.flush_s if self._held else self.retry_s)
            if 0 < len(self._queue) < self.batch_size and not self._closing:
                # Collect until the oldest record is a flush window old (or a batch is full). The window counts
                # from its submission, not from now: what arrived while the last batch was being written has
                # waited already, and under load goes out as soon as the writer is free.
                wait_s = self._queue[0][2] + self.flush_s - time.monotonic()
                if wait_s > 0:
                    self._full.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._full.wait(), wait_s)
            batch = self._held + [
                self._queue.popleft() for _ in range(min(self.batch_size, len(self._queue)))
            ]
            self._held = []
            records = [record for record, _, _ in batch]
            held: set[int] = set()
            try:
                if records:
                    held = {id(record) for record in await self._hold_back(records)}
                    records = [record for record in records if id(record) not in held]
                if records:
                    await self._write_or_spool(records)
                if self.spool.pending and time.monotonic() >= self._next_replay:
                    await self._replay()
            except Exception:  # the writer must outlive any single failure; the batch goes to the spool
                log.exception("capture writer error")
                self._spool(records)
            finally:
                # Written, spooled or counted dropped: the log no longer needs these records.
                self._held = [item for item in batch if id(item[0]) in held]
                done = [item for item in batch if id(item[0]) not in held]
                self._settle(segment for _, segment, _ in done)
                self._unsettled -= len(done)

    async def _sync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.fsync_s)
            try:
                await self.wal.sync()
            except OSError:
                log.exception("could not fsync the capture log")

    def _settle(self, segments: Iterable[int]) -> None:
        self.wal.settle(s for s in segments if s >= 0)

    async def _hold_back(self, records: list[CallRecord]) -> list[CallRecord]:
        """The follow-ups of this batch to keep for a later one: their earlier turn is in no stored call yet,
        and they are younger than the stitch grace period, so another replica may still be writing it.

        Stitching them now would start a new episode for the rest of the conversation. Everything else is
        settled here (one query, which `write_calls` then need not make). Not while shutting down or spooling.
        """
        if (
            self.stitch_grace_s <= 0
            or self._closing
            or not self.database_up
            or self.spool.pending
            or all(r.episode_resolved or not r.stitch_lookup for r in records)
        ):
            return []
        hold_after = time.time() - self.stitch_grace_s

        async def resolve(database: Database) -> list[CallRecord]:
            async with database.session() as session:
                return await resolve_stitched_episodes(session, records, hold_after=hold_after)

        try:
            if self._store_database is None:
                return await resolve(self.database)
            return await self._on_store_loop(resolve(self._store_database))
        except Exception as exc:  # the write that follows finds out whether the database is down
            log.warning("could not look up earlier turns of a capture batch: %s", exc)
            return []

    def _stored(self, batch: list[CallRecord]) -> None:
        if self.on_stored is not None:
            try:
                self.on_stored(batch)
            except Exception:
                log.exception("a listener of stored calls failed")

    async def _write_or_spool(self, batch: list[CallRecord], counter: str = "written") -> None:
        if self.spool.pending or not self.database_up:
            self._spool(batch)
            return
        written = await self._write(batch)
        if written is None:
            self._spool(batch)
        else:
            setattr(self.stats, counter, getattr(self.stats, counter) + written)
            self._stored(batch)

    async def _write(self, batch: list[CallRecord]) -> int | None:
        """Insert a batch; None when the database could not be reached (the caller spools it)."""
        try:
            return await self._store(batch)
        except _CONNECTION_ERRORS as exc:
            self._database_down(exc)
            return None
        except DBAPIError as exc:
            if exc.connection_invalidated or not await self.database.ping():
                self._database_down(exc)
                return None
            return await self._write_one_by_one(batch, exc)

    def _database_down(self, exc: BaseException) -> None:
        if self.database_up:
            log.warning("database unreachable, spooling captured calls to %s: %s", self.spool.path, exc)
        self.database_up = False
        self._next_replay = time.monotonic() + self.retry_s

    async def _write_one_by_one(self, batch: list[CallRecord], cause: BaseException) -> int:
        """The database is up but refused the batch: isolate the records it rejects, count them dropped."""
        log.error("database rejected a capture batch (%s); retrying record by record", cause)
        written = 0
        for record in batch:
            try:
                written += await self._store([record])
            except DBAPIError as exc:
                self.stats.dropped += 1
                log.error(
                    "dropped captured call %s (%d dropped so far): %s", record.id, self.stats.dropped, exc
                )
        return written

    async def _replay(self) -> None:
        if not await self.database.ping():
            self._database_down(ConnectionError("ping failed"))
            return
        if not self.database_up:
            log.info("database reachable again, replaying the spool")
        self.database_up = True
        self.spool.close()
        for batch in self.spool.read_batches(self.batch_size):
            written = await self._write(batch)
            if written is None:
                return  # still down; the whole file is replayed next time (writes are idempotent)
            self.stats.replayed += written
            self._stored(batch)
        self.spool.clear()

    def _spool(self, records: list[CallRecord]) -> None:
        try:
            self.spool.append(records)
            self.stats.spooled += len(records)
        except OSError:
            self.stats.dropped += len(records)
            log.exception(
                "could not spool %d captured calls: they are lost (%d dropped so far)",
                len(records),
                self.stats.dropped,
            )

    def snapshot(self) -> dict[str, Any]:
        return {
            **asdict(self.stats),
            "queue_depth": len(self._queue),
            "stitch_held": len(self._held),
            "log_unsettled": self.wal.unsettled,
            "log_bytes": self.wal.size_bytes(),
            "spool_bytes": self.spool.size_bytes(),
            "directory": str(self.spool.path.parent),
            "database_up": self.database_up,
        }
