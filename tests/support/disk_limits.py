"""A disk that is full for one process: the kernel refuses that process's writes that would grow a file, until
the limit is lifted (`RLIMIT_FSIZE`, set on the running process from outside with `prlimit`).

Why this, and not a small file system filled to the brim: mounting one (tmpfs, a loop device) needs privileges a
test run may not have, while `prlimit` on one's own child needs none, so the tests that use this never skip. The
process gets a real failed `write()` from the kernel: `EFBIG` where a full disk gives `ENOSPC`, both an `OSError`
on the same code path; Python ignores the `SIGXFSZ` that comes with it. What differs from a full disk is the
reach: only the limited process's writes fail (its capture writer, started before, is not limited), which is
the part under test, the serving process's capture log. docs/operations.md ("Disk full") tells of the same run on
a full 16 MiB tmpfs.

A limited process could not grow its own log file either, so `LogPipe` hands it a pipe instead (writes to a pipe
are not limited) and keeps what comes out."""

from __future__ import annotations

import os
import resource
import threading
from pathlib import Path

from gateway.commands.serve_process import GatewayProcess
from tests.support import proc_stats


def refuse_file_growth(pid: int) -> None:
    """From now on, every write of `pid` that would make a file longer fails (the disk is full)."""
    _, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (0, hard))


def allow_file_growth(pid: int) -> None:
    """Space is back: lift the limit `refuse_file_growth` set."""
    _, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (hard, hard))


def capture_writer_pid(gateway_pid: int) -> int:
    """The capture writer process of a one-process gateway."""
    for pid in proc_stats.child_pids(gateway_pid):
        if b"gateway.capture.writer" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise LookupError(f"gateway {gateway_pid} has no capture writer running")


class LogPipe:
    """The gateway's log through a FIFO at its `log_path`; each line is kept in `lines` and copied to `copy`
    (for a failed test's reader). Create it before the gateway starts: the gateway opens the FIFO then."""

    def __init__(self, gateway: GatewayProcess, copy: Path) -> None:
        os.mkfifo(gateway.log_path)
        self.path = gateway.log_path
        self.copy = copy
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, name="gateway-log-pipe", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        # Opening the read end waits for the gateway to open the write end; the loop ends when every process
        # holding that end (the gateway and its children) has exited.
        with self.path.open("rb") as fifo, self.copy.open("ab") as out:
            for line in fifo:
                out.write(line)
                out.flush()
                self.lines.append(line.decode(errors="replace"))

    def count(self, text: str) -> int:
        """Log lines containing `text` so far."""
        return sum(text in line for line in list(self.lines))
