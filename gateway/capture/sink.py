"""Capture: every answered call is durable before its answer goes out, and reaches SQL without the serving
process waiting on, or working for, the database.

The serving process only appends. `CaptureSink.submit` writes the call's record to the capture log (numbered
JSON-lines segments under `<data_dir>/spool/log/`) with one `write()` to the OS, so a kill of the process loses
nothing; fsync runs on a timer, which bounds what a power loss can take. The active segment is closed and a new
one started every second (and at `segment_bytes`).

A capture writer in a process of its own (`gateway.capture.writer`) tails the segments, decodes each line once
and stores batches in SQL; it deletes a segment once every call in it is committed. A batch goes out when it is
full, or early enough that its oldest call is committed within the flush window. Being a separate interpreter,
its per-row work (decoding, parameter conversion, the drivers) never queues behind the serving thread for the
interpreter lock, which is what held the backlog above the window when it was a thread here, and the serving
process spends its CPU on serving.

- **Start:** segments an earlier process left (killed, or past its drain timeout) are stored before the gateway
  serves. Writes are idempotent by the server-generated call id, so a call is stored once.
- **Database down:** the calls wait in the log (the log is the spool); the writer counts them, retries, and
  stores them in order once the database answers.
- **Shutdown:** after serving has ended, the log is closed and the writer drains it, for up to
  `drain_timeout_s`; what is left stays in the log for the next start.
- **The writer dies:** it is restarted after `retry_s`; the new one stores what the old one had not.
- **Several replicas on one data directory:** each process claims a capture directory of its own
  (`gateway.capture.directory`), so no writer stores or deletes another process's log.
- **A follow-up whose earlier turn another replica answered:** with `stitch_grace_ms`, the writer holds it back
  until that turn is stored (or the grace period is over), and reports the final episode of every call the gateway
  stitched provisionally, which settles the gateway's stitch cache.
- **The log cannot be written** (disk full): by default the call is still answered, and its record goes to the
  writer over its stdin instead, in memory only (`log_failures` counts it), up to `memory_limit_bytes` not yet
  stored; past that it is dropped from capture. The log is tried again every second with a probe write, so the
  sink goes back to it by itself once space returns. While this lasts the loss of durability shows: `state` is
  `memory` (`/readyz`), the metrics count the calls held in memory, and an error line is logged at its start and
  every `_OUTAGE_REPORT_S`. With `require_durable`, a call whose record cannot be logged is refused instead
  (`submit` says so; `refusing` turns new calls away before they reach the engine).

The writer reports its counters after every batch; `snapshot()` (`GET /admin/capture`) merges them with this
side's. Every loss is counted in `dropped` and logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NamedTuple

import msgspec

from gateway.capture.directory import CaptureDirectory
from gateway.capture.writer import (
    DRAIN,
    LINE_LIMIT,
    WriterConfig,
    WriterLog,
    WriterMessage,
    WriterStatus,
    WriterStored,
    segment_numbers,
    segment_path,
)
from gateway.peers import PeerLink
from storage.records import CallRecord
from trainer.control.child_processes import own_modules_environment

log = logging.getLogger(__name__)

# The active segment is closed this often (if it holds anything), so the writer can delete committed calls.
_ROTATE_S = 1.0
# How long the writer may take to exit past its own drain timeout before it is killed, and to report that it is
# up (a drain is timed from then: its imports take seconds on a busy machine).
_EXIT_GRACE_S = 5.0
_START_TIMEOUT_S = 60.0
# The spool file of earlier versions, which held calls while the database was down: stored like a leftover.
_LEGACY_SPOOL = "calls.jsonl"
# While the log cannot be written: how often it is tried again, with a write of how many bytes to a scratch file
# beside it (a few blocks, so that a disk with room for a byte but not for a call does not count as writable),
# and how often the error line is repeated.
_LOG_RETRY_S = 1.0
_PROBE_BYTES = 64 * 2**10
_PROBE_FILE = ".probe"
_OUTAGE_REPORT_S = 30.0


@dataclass
class CaptureStats:
    """This side's counters; the writer's are in `WriterStatus`."""

    queued: int = 0  # submitted: appended to the log (or handed to the writer in memory)
    dropped: int = 0  # lost on this side: neither in the log nor handed to a running writer
    log_failures: int = 0  # could not be appended to the log (not durable until written)
    opted_out: int = 0  # served with `X-Kaizen-No-Log: true`, nothing stored
    writer_restarts: int = 0  # the writer process exited unexpectedly and was started again
    refused: int = 0  # answered calls refused because the log could not take them (`require_durable`)


class WriteAheadLog:
    """The serving process's end of the capture log: numbered JSON-lines segments (`<n>.jsonl`), append-only.

    `append` is one unbuffered `write()`: the line is in the OS once it returns, which survives a kill of the
    process. A new segment is created right after the previous one is closed, so the writer can take a segment
    as complete once the next exists. Only the event loop's thread appends, so no lock is needed.
    """

    def __init__(self, directory: Path, segment_bytes: int, *, fsync: bool = True) -> None:
        self.directory = directory
        self.segment_bytes = segment_bytes
        self.fsync = fsync
        self.segment = 0
        self._encoder = msgspec.json.Encoder()
        self._file: IO[bytes] | None = None
        self._size = 0
        self._dirty = False  # written since its last fsync
        self._unsynced: list[int] = []  # duplicate descriptors of closed segments written since their fsync
        self._created_at = time.monotonic()

    def open(self) -> int:
        """Start a segment after any an earlier process left (they are the writer's leftovers); returns it."""
        self.directory.mkdir(parents=True, exist_ok=True)
        found = segment_numbers(self.directory)
        self.segment = max(self.segment, found[-1] + 1 if found else 0)
        legacy = self.directory.parent / _LEGACY_SPOOL
        if legacy.is_file():
            if legacy.stat().st_size:
                legacy.rename(segment_path(self.directory, self.segment))
                self.segment += 1
            else:
                legacy.unlink()
        self._create()
        return self.segment

    def append(self, record: CallRecord) -> None:
        """Append one record. Raises OSError when it is not in the log."""
        if self._file is None:  # closed at shutdown: a call finished after the drain waits for the next start
            self.directory.mkdir(parents=True, exist_ok=True)
            self._create()
        assert self._file is not None
        line = self._encoder.encode(record) + b"\n"
        written = self._file.write(line)
        if written != len(line):  # a short write (disk full): its torn line ends this segment
            self.rotate()
            raise OSError(errno.ENOSPC, "short write to the capture log")
        self._size += written
        self._dirty = True
        if self._size >= self.segment_bytes:
            self.rotate()

    def probe(self) -> None:
        """Whether the log's file system takes writes again: write `_PROBE_BYTES` to a scratch file beside the
        segments (the writer reads only segments) and delete it. Raises OSError when it cannot."""
        path = self.directory / _PROBE_FILE
        try:
            with path.open("wb", buffering=0) as probe:
                if probe.write(bytes(_PROBE_BYTES)) != _PROBE_BYTES:
                    raise OSError(errno.ENOSPC, "short write to the capture log's directory")
        finally:
            path.unlink(missing_ok=True)

    def rotate(self) -> None:
        """Close the active segment and start the next (the writer then takes the closed one as complete)."""
        self._close()
        self.segment += 1
        self._create()

    async def tick(self) -> None:
        """Every fsync interval (or second): close the active segment if it holds calls and is a rotation
        interval old, so the writer can delete it once stored; fsync what was written, off the event loop."""
        if self._file is not None and self._size and time.monotonic() - self._created_at >= _ROTATE_S:
            self.rotate()
        await self.sync()

    async def sync(self) -> None:
        """fsync every segment written since its last fsync (a kill needs none; a power loss does)."""
        if self._dirty and self._file is not None and self.fsync:
            self._unsynced.append(os.dup(self._file.fileno()))
            self._dirty = False
        handles, self._unsynced = self._unsynced, []
        for handle in handles:
            try:
                await asyncio.to_thread(os.fsync, handle)
            finally:
                os.close(handle)

    def size_bytes(self) -> int:
        total = 0
        for segment in segment_numbers(self.directory):
            with contextlib.suppress(FileNotFoundError):  # the writer deletes segments meanwhile
                total += segment_path(self.directory, segment).stat().st_size
        return total

    def close(self) -> None:
        """Close the active segment (deleted when empty). Later appends go to a new one."""
        if self._file is None:
            return
        empty = not self._size
        self._close()
        if empty:
            segment_path(self.directory, self.segment).unlink(missing_ok=True)
        self.segment += 1

    def _create(self) -> None:
        self._file = segment_path(self.directory, self.segment).open("ab", buffering=0)
        self._size = 0
        self._dirty = False
        self._created_at = time.monotonic()

    def _close(self) -> None:
        if self._file is None:
            return
        if self._dirty and self.fsync:
            self._unsynced.append(os.dup(self._file.fileno()))
        self._file.close()
        self._file = None


#: What sibling workers ask each other about an episode (`answer_peers`).
EPISODE_QUEUED_TOPIC = "episode-queued"


class HandOff(NamedTuple):
    """Where a call stands among those handed to the capture writers: the `writer`-th started, its `nth` call."""

    writer: int
    nth: int


class RecentTargets:
    """Ids of recently submitted calls and their episodes (bounded), so feedback that arrives before the
    writer stores its target (still in the log, or waiting for the database) is recognised and accepted. Client
    request ids map to the newest call that carried them."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._calls: OrderedDict[str, tuple[str, str | None]] = OrderedDict()
        # episode id -> (policy, the hand-off mark of its newest call handed to a writer, if any)
        self._episodes: OrderedDict[str, tuple[str | None, HandOff | None]] = OrderedDict()
        self._clients: OrderedDict[str, str] = OrderedDict()

    def remember(self, record: CallRecord, handed: HandOff | None) -> None:
        """`handed`: where the call stands among those handed to the writer; None if it was not handed."""
        earlier = self._episodes.get(record.episode_id)
        if handed is None and earlier is not None:
            handed = earlier[1]  # an earlier call of the episode may still be on its way
        self._calls[record.id] = (record.episode_id, record.policy)
        self._episodes[record.episode_id] = (record.policy, handed)
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
        found = self._episodes.get(episode_id)
        return (found is not None, found[0] if found is not None else None)

    def newest_handed(self, episode_id: str) -> HandOff | None:
        """The hand-off mark of the newest call of a recent episode handed to a writer."""
        found = self._episodes.get(episode_id)
        return found[1] if found is not None else None


class CaptureSink:
    """The capture log and the writer process that stores it."""

    def __init__(
        self,
        database_url: str,
        log_dir: Path,
        *,
        batch_size: int = 500,
        flush_ms: float = 50.0,
        retry_s: float = 1.0,
        fsync_ms: float = 1000.0,
        segment_bytes: int = 16 * 2**20,
        drain_timeout_s: float = 30.0,
        recent_size: int = 100_000,
        stitch_grace_ms: float = 0.0,
        memory_limit_bytes: int = 64 * 2**20,
        require_durable: bool = False,
    ) -> None:
        self.database_url = database_url
        self.wal = WriteAheadLog(log_dir, segment_bytes, fsync=fsync_ms > 0)
        self.stats = CaptureStats()
        self.batch_size = batch_size
        self.flush_ms = flush_ms
        self.retry_s = retry_s
        self.tick_s = fsync_ms / 1000 if fsync_ms > 0 else _ROTATE_S
        self.drain_timeout_s = drain_timeout_s
        self.recent = RecentTargets(recent_size)
        self.stitch_grace_ms = stitch_grace_ms
        # Told (call id, final episode id) of stored calls whose episode was provisional (the chat service settles
        # its stitch cache with them).
        self.on_stored: Callable[[list[tuple[str, str]]], None] | None = None
        self.writer = WriterStatus()  # the running writer's last report
        self._earlier = WriterStatus()  # the counters of writers that exited unexpectedly, summed
        self._handed = 0  # calls appended or piped since the running writer started
        self._writer_starts = 0  # writers started so far: which one a call was handed to (`HandOff`)
        self._peers: PeerLink | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._listener: asyncio.Task[None] | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._closing = False
        self._writer_up = asyncio.Event()  # the running writer has reported (its imports are done)
        self._encoder = msgspec.json.Encoder()
        self._decoder = msgspec.json.Decoder(WriterMessage)
        self._directory: CaptureDirectory | None = None
        self.memory_limit_bytes = memory_limit_bytes
        self.require_durable = require_durable
        self._log_error: str | None = None  # why the log cannot be written, while it cannot
        self._log_down_at = 0.0  # since when (monotonic)
        self._next_log_try = 0.0
        self._reported_at = -_OUTAGE_REPORT_S  # the last outage line (error or dropped call) logged
        self._outage = CaptureStats()  # what the current (or last) outage cost
        self._memory_calls = 0  # calls sent to the running writer in memory, and their line bytes
        self._memory_bytes = 0

    # ------------------------------------------------------------------ request path
    def submit(self, record: CallRecord) -> bool:
        """Make a record durable and leave it to the writer. Never blocks and never raises into the request:
        call it before the answer's last byte is sent.

        When the log cannot take it, a record is held in memory for the writer (or dropped from capture past
        `memory_limit_bytes`), and the call is answered all the same; but with `require_durable` an answered
        call's record (status `ok`) is not kept, and False says that the caller must refuse the call."""
        if self._log_error is None:
            try:
                self.wal.append(record)
            except OSError as exc:
                self._log_failed(exc)
            else:
                self.stats.queued += 1
                self._handed += 1
                self.recent.remember(record, HandOff(self._writer_starts, self._handed))
                return True
        if self.require_durable and record.status == "ok":
            self.stats.refused += 1
            self._outage.refused += 1
            return False
        self.stats.queued += 1
        self.stats.log_failures += 1
        self._outage.log_failures += 1
        handed = self._hold_in_memory(record)
        self.recent.remember(record, HandOff(self._writer_starts, self._handed) if handed else None)
        return True

    def _hold_in_memory(self, record: CallRecord) -> bool:
        """Send a call to the writer in memory; False if it is dropped instead."""
        process = self._process
        if process is None or process.returncode is not None or process.stdin is None or self._closing:
            self._drop(record, "not in the capture log and no capture writer running")
            return False
        line = self._encoder.encode(record) + b"\n"
        if self.memory_bytes + len(line) > self.memory_limit_bytes:
            self._drop(record, f"the {self.memory_limit_bytes} bytes of calls held in memory are taken")
            return False
        process.stdin.write(line)  # buffered by the transport; never blocks
        self._memory_calls += 1
        self._memory_bytes += len(line)
        self._handed += 1
        return True

    def _drop(self, record: CallRecord, reason: str) -> None:
        self.stats.dropped += 1
        self._outage.dropped += 1
        if time.monotonic() - self._reported_at >= _OUTAGE_REPORT_S:
            self._reported_at = time.monotonic()
            log.error(
                "dropped captured call %s: %s (%d dropped so far; it was answered, and will not be stored)",
                record.id,
                reason,
                self.stats.dropped,
            )

    @property
    def memory_calls(self) -> int:
        """Answered calls held only in memory: sent to the writer, not stored yet; lost if the gateway dies."""
        return self._memory_calls - self.writer.memory_settled

    @property
    def memory_bytes(self) -> int:
        return self._memory_bytes - self.writer.memory_settled_bytes

    @property
    def refusing(self) -> bool:
        """Strict mode while the log cannot be written: new calls are refused before they reach the engine."""
        return self.require_durable and self._log_error is not None

    @property
    def state(self) -> str:
        """`log` (durable), `memory` (calls answered but held in memory) or `refusing` (`require_durable`)."""
        if self._log_error is None:
            return "log"
        return "refusing" if self.require_durable else "memory"

    # ------------------------------------------------------------------ the log failing and coming back
    def _log_failed(self, exc: OSError) -> None:
        now = time.monotonic()
        self._log_error = str(exc)
        self._log_down_at = now
        self._next_log_try = now + _LOG_RETRY_S
        self._outage = CaptureStats()
        if now - self._reported_at < _OUTAGE_REPORT_S:
            return  # it came back and failed again within the interval: the next report covers it
        self._reported_at = now
        if self.require_durable:
            log.error(
                "the capture log cannot be written (%s): calls are refused with 503 capture_unavailable "
                "until it can (capture_require_durable); trying it again every %g s",
                exc,
                _LOG_RETRY_S,
            )
        else:
            log.error(
                "the capture log cannot be written (%s): answered calls are held in memory for the capture "
                "writer (up to %d bytes, then dropped from capture) and are lost if the gateway dies before "
                "they are stored; trying the log again every %g s",
                exc,
                self.memory_limit_bytes,
                _LOG_RETRY_S,
            )

    def _retry_log(self) -> None:
        """While the log cannot be written: try it again (a probe write), report the outage every
        `_OUTAGE_REPORT_S`, and go back to the log once it takes writes."""
        now = time.monotonic()
        if now < self._next_log_try:
            return
        self._next_log_try = now + _LOG_RETRY_S
        try:
            self.wal.probe()
        except OSError as exc:
            self._log_error = str(exc)
            if now - self._reported_at >= _OUTAGE_REPORT_S:
                self._reported_at = now
                log.error(
                    "the capture log still cannot be written (%s), for %.0f s now: %d calls held in memory "
                    "(%d bytes), %d dropped and %d refused since it started",
                    exc,
                    now - self._log_down_at,
                    self.memory_calls,
                    self.memory_bytes,
                    self._outage.dropped,
                    self._outage.refused,
                )
            return
        log.info(
            "the capture log can be written again after %.0f s: calls are durable again (%d went to the capture "
            "writer in memory meanwhile, %d still held there; %d dropped, %d refused)",
            now - self._log_down_at,
            self._outage.log_failures,
            self.memory_calls,
            self._outage.dropped,
            self._outage.refused,
        )
        self._log_error = None

    @property
    def closing(self) -> bool:
        """Shutdown has begun: new calls are refused (anything submitted anyway is still logged)."""
        return self._closing

    def opt_out(self) -> None:
        self.stats.opted_out += 1

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the writer; when an earlier process left calls in the log, wait until they are stored (before
        serving). Otherwise serving need not wait for the writer's start-up (a second or more of imports on a
        busy machine): calls wait in the log meanwhile."""
        self._claim_directory()
        live_from = self.wal.open()
        await self._spawn(live_from)
        if any(segment < live_from for segment in segment_numbers(self.wal.directory)):
            await self._wait_ready()
        self._supervisor = asyncio.create_task(self._supervise(), name="capture-writer-supervisor")
        self._ticker = asyncio.create_task(self._tick(), name="capture-log-tick")

    async def stop(self) -> None:
        """Serving has ended: close the log, and let the writer store everything in it, then exit."""
        self._closing = True
        for task in (self._supervisor, self._ticker):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self.wal.close()
        with contextlib.suppress(OSError):
            await self.wal.sync()
        process = self._process
        if process is None or process.returncode is not None:
            log.warning(
                "no capture writer at shutdown: calls not yet stored stay in the log for the next start"
            )
            self._release_directory()
            return
        assert process.stdin is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._writer_up.wait(), _START_TIMEOUT_S)
        process.stdin.write(DRAIN)
        with contextlib.suppress(ConnectionError):
            await process.stdin.drain()
        process.stdin.close()
        try:
            await asyncio.wait_for(process.wait(), self.drain_timeout_s + _EXIT_GRACE_S)
        except TimeoutError:
            log.error("the capture writer did not exit after its drain: killing it (the log keeps the calls)")
            process.kill()
            await process.wait()
        if self._listener is not None:
            await self._listener
        lost = self._lose_memory("at shutdown: the capture writer did not store them in time")
        left = self._handed - self.writer.settled - lost
        if left > 0:
            log.warning("%d captured calls stay in the capture log for the next start", left)
        self._release_directory()

    def _lose_memory(self, when: str) -> int:
        """The writer is gone: the calls it held only in memory are lost. Counts and logs them."""
        lost = self.memory_calls
        self._memory_calls, self._memory_bytes = self.writer.memory_settled, self.writer.memory_settled_bytes
        if lost > 0:
            self.stats.dropped += lost
            self._outage.dropped += lost
            log.error("%d captured calls held only in memory were lost %s", lost, when)
        return lost

    @property
    def database_up(self) -> bool:
        """As the writer last saw it."""
        return self.writer.database_up

    def _claim_directory(self) -> None:
        """Take a capture directory no other live process uses (replicas may share the data directory)."""
        root = self.wal.directory.parent
        self._directory = CaptureDirectory.claim(root)
        if self._directory.path != root:
            self.wal = WriteAheadLog(
                self._directory.path / self.wal.directory.name, self.wal.segment_bytes, fsync=self.wal.fsync
            )

    def _release_directory(self) -> None:
        if self._directory is not None:
            self._directory.release()
            self._directory = None

    # ------------------------------------------------------------------ the writer process
    async def _spawn(self, live_from: int) -> None:
        config = WriterConfig(
            database_url=self.database_url,
            log_dir=str(self.wal.directory),
            live_from=live_from,
            batch_size=self.batch_size,
            flush_ms=self.flush_ms,
            retry_s=self.retry_s,
            drain_timeout_s=self.drain_timeout_s,
            stitch_grace_ms=self.stitch_grace_ms,
            log_level=logging.getLogger("gateway.capture.writer").getEffectiveLevel(),
        )
        self._handed = 0  # counted from here: what was handed to an earlier writer is a leftover for this one
        self._writer_starts += 1
        self._memory_calls = self._memory_bytes = 0
        self.writer = WriterStatus()
        self._writer_up = asyncio.Event()
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gateway.capture.writer",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            # The writer must run this very code: the log's format and the pipe's messages are shared.
            env=own_modules_environment(),
            limit=LINE_LIMIT,
        )
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(self._encoder.encode(config) + b"\n")
        self._process = process
        self._listener = asyncio.create_task(self._listen(process.stdout), name="capture-writer-listener")

    async def _listen(self, stdout: asyncio.StreamReader) -> None:
        """The writer's counters and log records, until it exits."""
        while line := await stdout.readline():
            try:
                message = self._decoder.decode(line)
            except msgspec.DecodeError:
                log.warning("unexpected output from the capture writer: %r", line[:200])
                continue
            self._writer_up.set()
            if isinstance(message, WriterLog):
                logging.getLogger(message.name).log(message.level, "%s", message.message)
            elif isinstance(message, WriterStored):
                if self.on_stored is not None:
                    try:
                        self.on_stored(message.calls)
                    except Exception:
                        log.exception("a listener of stored calls failed")
            else:
                self.writer = message

    async def _wait_ready(self) -> None:
        process = self._process
        assert process is not None
        while not self.writer.ready:
            if process.returncode is not None:
                raise RuntimeError(f"the capture writer exited with status {process.returncode} at start-up")
            await asyncio.sleep(0.01)

    async def _supervise(self) -> None:
        """Restart a writer that exits while the gateway serves; the new one stores what the old one had not."""
        while True:
            assert self._process is not None and self._listener is not None
            status = await self._process.wait()
            await self._listener
            self.stats.writer_restarts += 1
            log.error("the capture writer exited with status %s; restarting it in %g s", status, self.retry_s)
            self._lose_memory("with the capture writer that exited")
            for name in ("written", "spooled", "replayed", "recovered", "dropped"):
                setattr(self._earlier, name, getattr(self._earlier, name) + getattr(self.writer, name))
            self.writer = WriterStatus()
            await asyncio.sleep(self.retry_s)
            try:
                self.wal.rotate()  # what the old writer had not stored is now a leftover for the new one
            except (
                OSError
            ) as exc:  # the next segment cannot be created (a full disk): the next append retries
                if self._log_error is None:
                    self._log_failed(exc)
            await self._spawn(self.wal.segment)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            if self._log_error is not None:
                self._retry_log()
            try:
                await self.wal.tick()
            except OSError:
                if self._log_error is None:  # otherwise reported as the log's outage
                    log.exception("could not rotate or fsync the capture log")

    # ------------------------------------------------------------------ progress
    @property
    def settling(self) -> bool:
        """Something submitted is not yet stored: in the log on its way, or waiting for the database."""
        return not self.writer.ready or self.writer.settled < self._handed

    def answer_peers(self, link: PeerLink) -> None:
        """As one of several serving workers: tell the others whether an episode has turns in this worker's
        queue, and ask them in `episode_queued`."""
        link.answer(
            EPISODE_QUEUED_TOPIC, lambda episode_id: b"1" if self.episode_settling(episode_id) else b"0"
        )
        self._peers = link

    async def episode_queued(self, episode_id: str) -> bool:
        """A call of this episode answered by this process, or by a sibling worker, is not yet stored."""
        if self.episode_settling(episode_id):
            return True
        if self._peers is None:
            return False
        answers = await self._peers.ask(EPISODE_QUEUED_TOPIC, episode_id)
        return b"1" in answers.values()

    def episode_settling(self, episode_id: str) -> bool:
        """A call of this recent episode that this process answered is not yet stored (or dropped).

        The writer stores calls in the order they were handed to it, so the newest call's place among them says
        whether it is through; a call handed to an earlier writer (before a restart) is through once the running
        one has stored the leftovers. Two exceptions may make the answer early: a follow-up held back for another
        replica's turn (`stitch_grace_ms`), which later calls pass, and calls sent in memory while the log could
        not be written, which the writer takes between lines of the log."""
        handed = self.recent.newest_handed(episode_id)
        if handed is None:
            return False
        if not self.writer.ready:
            return True
        return handed.writer == self._writer_starts and self.writer.settled < handed.nth

    async def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until everything submitted so far is stored or held for a database that is down (tests)."""
        process, target = self._process, self._handed
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process is not self._process:  # restarted: the new writer had the rest as leftovers
                process, target = self._process, 0
            if self.writer.ready and self.writer.settled + self.writer.held >= target:
                return
            await asyncio.sleep(0.005)

    def snapshot(self) -> dict[str, Any]:
        writer, earlier = self.writer, self._earlier
        return {
            "queued": self.stats.queued,
            "written": earlier.written + writer.written,
            "spooled": earlier.spooled + writer.spooled,
            "replayed": earlier.replayed + writer.replayed,
            "recovered": earlier.recovered + writer.recovered,
            "dropped": self.stats.dropped + earlier.dropped + writer.dropped,
            "log_failures": self.stats.log_failures,
            "refused": self.stats.refused,
            "opted_out": self.stats.opted_out,
            "writer_restarts": self.stats.writer_restarts,
            "queue_depth": max(0, self._handed - writer.settled - writer.held - writer.writing),
            "writing": writer.writing,
            "log_unsettled": max(0, self._handed - writer.settled),
            "log_bytes": self.wal.size_bytes(),
            "directory": str(self.wal.directory.parent),
            "spool_bytes": writer.spool_bytes,
            "database_up": writer.database_up,
            "durable": self._log_error is None,
            "memory_calls": self.memory_calls,
            "memory_bytes": self.memory_bytes,
        }
