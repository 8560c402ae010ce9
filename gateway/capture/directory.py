"""One capture directory per gateway process, also when several replicas share a data directory.

A gateway's capture log and spool must be its own: a replica that started on another's directory would replay
and delete log segments the other is still appending to, and truncate records it has not stored yet. Each process
holds an exclusive `flock` on a directory's `.lock` file for as long as it captures. The first process on a data
directory gets `<data_dir>/spool` itself (the layout of a single gateway), the next `<data_dir>/spool/replica-1`,
and so on. The kernel releases a lock when its holder exits, however it exits, so the next process to take that
directory finds what the previous one left and stores it before serving (the log's usual recovery).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

#: Replicas that can share one data directory.
MAX_REPLICAS = 256


class CaptureDirectory:
    """A directory this process holds for its capture log and spool, until `release`."""

    def __init__(self, path: Path, descriptor: int) -> None:
        self.path = path
        self._descriptor: int | None = descriptor

    @classmethod
    def claim(cls, root: Path) -> CaptureDirectory:
        """The first of `root`, `root/replica-1`, ... that no live process holds."""
        for index in range(MAX_REPLICAS):
            path = root if index == 0 else root / f"replica-{index}"
            path.mkdir(parents=True, exist_ok=True)
            descriptor = os.open(path / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(descriptor)
                continue
            if index:
                log.info("capture directory %s is in use by another process; capturing to %s", root, path)
            return cls(path, descriptor)
        raise RuntimeError(f"all {MAX_REPLICAS} capture directories under {root} are in use")

    def release(self) -> None:
        descriptor, self._descriptor = self._descriptor, None
        if descriptor is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(descriptor, fcntl.LOCK_UN)
            os.close(descriptor)


def directories_in_use(root: Path) -> list[Path]:
    """The capture directories under `root` that a live process holds: a gateway serving on this data directory
    (what a restore must not write under)."""
    held = []
    for index in range(MAX_REPLICAS):
        path = root if index == 0 else root / f"replica-{index}"
        try:
            descriptor = os.open(path / ".lock", os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            held.append(path)
        finally:
            os.close(descriptor)  # closing the descriptor releases a lock taken through it
    return held
