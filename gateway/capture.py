"""Capture: completed calls go from the request path to SQL without the request ever waiting on the database.

`CaptureSink.submit` only appends to a bounded in-memory queue. One writer task inserts batches. When the database
fails, batches go to an append-only spool file (JSON lines) and are replayed in order once it answers again;
while the spool holds anything, new batches are appended behind it so order is kept. Writes are idempotent by
call id, so a batch whose commit outcome was unknown is safely replayed. Every path is counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import msgspec
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from storage.calls import write_calls
from storage.database import Database
from storage.records import CallRecord

log = logging.getLogger(__name__)

_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (OperationalError, PoolTimeout, OSError, TimeoutError)


@dataclass
class CaptureStats:
    queued: int = 0  # accepted into the in-memory queue
    written: int = 0  # inserted into the database straight from the queue
    spooled: int = 0  # appended to the spool file (database down, or queue full)
    replayed: int = 0  # moved from the spool file into the database
    dropped: int = 0  # lost: could be neither written nor spooled, or rejected by the database as invalid
    opted_out: int = 0  # served with `X-Kaizen-No-Log: true`, nothing stored


class Spool:
    """Append-only JSON-lines file of records waiting for the database."""

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
        batches: list[list[CallRecord]] = []
        current: list[CallRecord] = []
        with self.path.open("rb") as handle:
            for line in handle:
                if not line.strip():
                    continue
                try:
                    current.append(self._decoder.decode(line))
                except msgspec.DecodeError:
                    log.error("skipping a torn line in the spool (a crash mid-write)")
                    continue
                if len(current) >= batch_size:
                    batches.append(current)
                    current = []
        if current:
            batches.append(current)
        return batches

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
    """The bounded queue, its writer task and the spool."""

    def __init__(
        self,
        database: Database,
        spool_path: Path,
        *,
        queue_size: int = 50_000,
        batch_size: int = 500,
        flush_ms: float = 50.0,
        retry_s: float = 1.0,
    ) -> None:
        self.database = database
        self.spool = Spool(spool_path)
        self.stats = CaptureStats()
        self.batch_size = batch_size
        self.flush_s = flush_ms / 1000
        self.retry_s = retry_s
        self.database_up = True
        self._queue: asyncio.Queue[CallRecord] = asyncio.Queue(maxsize=queue_size)
        self._task: asyncio.Task[None] | None = None
        self._next_replay = 0.0
        self._unsettled = 0  # submitted records not yet in the database or the spool
        self.recent = RecentTargets(max(queue_size, 100_000))

    # ------------------------------------------------------------------ request path
    def submit(self, record: CallRecord) -> None:
        """Hand a record to the writer. Never blocks and never raises into the request."""
        self.recent.remember(record)
        try:
            self._queue.put_nowait(record)
            self.stats.queued += 1
            self._unsettled += 1
        except asyncio.QueueFull:
            self._spool([record])

    def opt_out(self) -> None:
        self.stats.opted_out += 1

    # ------------------------------------------------------------------ writer
    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="capture-writer")

    async def stop(self) -> None:
        """Drain the queue (to the database, or the spool) and stop the writer."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        remaining = []
        while not self._queue.empty():
            remaining.append(self._queue.get_nowait())
        for start in range(0, len(remaining), self.batch_size):
            await self._write_or_spool(remaining[start : start + self.batch_size])
        if self.spool.pending and self.database_up:
            await self._replay()
        self.spool.close()

    async def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until everything submitted so far is in the database or the spool (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._unsettled > 0 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)

    async def _run(self) -> None:
        while True:
            batch = await self._next_batch()
            try:
                if batch:
                    await self._write_or_spool(batch)
                if self.spool.pending and time.monotonic() >= self._next_replay:
                    await self._replay()
            except Exception:  # the writer must outlive any single failure
                log.exception("capture writer error")
            finally:
                self._unsettled -= len(batch)

    async def _next_batch(self) -> list[CallRecord]:
        try:
            first = await asyncio.wait_for(self._queue.get(), timeout=self.retry_s)
        except TimeoutError:
            return []
        batch = [first]
        deadline = time.monotonic() + self.flush_s
        while len(batch) < self.batch_size:
            if self._queue.empty():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), timeout=remaining))
                except TimeoutError:
                    break
            else:
                batch.append(self._queue.get_nowait())
        return batch

    async def _write_or_spool(self, batch: list[CallRecord]) -> None:
        if self.spool.pending or not self.database_up:
            self._spool(batch)
            return
        written = await self._write(batch)
        if written is None:
            self._spool(batch)
        else:
            self.stats.written += written

    async def _write(self, batch: list[CallRecord]) -> int | None:
        """Insert a batch; None when the database could not be reached (the caller spools it)."""
        try:
            async with self.database.session() as session:
                return await write_calls(session, batch)
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
                async with self.database.session() as session:
                    written += await write_calls(session, [record])
            except DBAPIError as exc:
                self.stats.dropped += 1
                log.error("dropped captured call %s: %s", record.id, exc)
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
        self.spool.clear()

    def _spool(self, records: list[CallRecord]) -> None:
        try:
            self.spool.append(records)
            self.stats.spooled += len(records)
        except OSError:
            self.stats.dropped += len(records)
            log.exception("could not spool %d captured calls: they are lost", len(records))

    def snapshot(self) -> dict[str, Any]:
        return {
            **asdict(self.stats),
            "queue_depth": self._queue.qsize(),
            "spool_bytes": self.spool.size_bytes(),
            "database_up": self.database_up,
        }
