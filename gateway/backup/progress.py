"""Log lines while a backup or a restore works through something long: copies, checksums, a database dump."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

log = logging.getLogger("kaizen")

#: Least time between two progress lines of one piece of work.
EVERY_S = 5.0


def mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def file_size(path: Path) -> int:
    """A file's size, 0 while it does not exist yet."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


class Meter:
    """Bytes done out of a known total, logged at most every `EVERY_S` seconds."""

    def __init__(self, what: str, total: int) -> None:
        self.what = what
        self.total = total
        self.done = 0
        self._next = time.monotonic() + EVERY_S

    def add(self, size: int) -> None:
        self.done += size
        if time.monotonic() >= self._next:
            self._next = time.monotonic() + EVERY_S
            log.info("%s: %s of %s", self.what, mib(self.done), mib(self.total))


@contextlib.asynccontextmanager
async def ticking(what: str, growing: Path | None = None) -> AsyncIterator[None]:
    """While the block runs (a dump, a restore, SQLite's backup step), log every `EVERY_S` seconds that it still
    does, with how large the file it writes (`growing`) has grown."""
    started = time.monotonic()

    async def tick() -> None:
        while True:
            await asyncio.sleep(EVERY_S)
            elapsed = time.monotonic() - started
            if growing is None:
                log.info("%s: %.0f s", what, elapsed)
            else:
                log.info("%s: %s written, %.0f s", what, mib(file_size(growing)), elapsed)

    ticker = asyncio.create_task(tick())
    try:
        yield
    finally:
        ticker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ticker
