"""CPU time and memory of running processes, from Linux's `/proc`, for benchmarks that compare work done per
call (load-independent, unlike wall time on a shared machine)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str]:
    """The fields of `/proc/<pid>/stat` after the command name (which may hold spaces): state is [0]."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()


def cpu_seconds(pid: int, *, with_reaped_children: bool = False) -> float:
    """User plus system CPU time of a process; with the children it has waited for, if asked."""
    fields = _stat(pid)
    ticks = int(fields[11]) + int(fields[12])
    if with_reaped_children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / _TICKS_PER_S


def child_pids(pid: int) -> list[int]:
    """The running children of a process."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                if int(_stat(int(entry.name))[1]) == pid:
                    children.append(int(entry.name))
    return children


def running(pid: int) -> bool:
    """Whether a process still runs: an exited one not reaped yet (a zombie) does not."""
    try:
        return _stat(pid)[0] != "Z"
    except (OSError, IndexError):
        return False


def processes_with(variable: str) -> list[int]:
    """The running processes (zombies aside) whose environment holds `variable` (`NAME=value`): a test's
    children and everything they started, however deep."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                environment = (entry / "environ").read_bytes().split(b"\0")
                if variable.encode() in environment and running(int(entry.name)):
                    found.append(int(entry.name))
    return found


def tree_cpu_seconds(pid: int) -> float:
    """CPU time of a process, its running children and the children it has reaped (a server's backends)."""
    total = cpu_seconds(pid, with_reaped_children=True)
    for child in child_pids(pid):
        with contextlib.suppress(OSError):
            total += cpu_seconds(child)
    return total


def rss_bytes(pid: int) -> int:
    """Resident memory of a process."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS line in /proc/{pid}/status")
