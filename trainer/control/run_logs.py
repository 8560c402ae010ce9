"""Where a training run's output goes: the policy's log, which every run of the policy appends to (one file to
follow), and a log of the run's own (`logs/runs/train-<run id>.log`), which the dashboard's run page shows.

The child records its run itself, a moment after it starts: until the scheduler sees that run, the lines wait
in memory (the last `PENDING_LINES`), then they open the run's file. A child that dies before it records a run
gets the run the scheduler records for it, and its lines with it.
"""

from __future__ import annotations

import collections
from pathlib import Path
from types import TracebackType
from typing import IO

PENDING_LINES = 10_000


def run_log_path(data_dir: Path, run_id: int) -> Path:
    return data_dir / "logs" / "runs" / f"train-{run_id}.log"


def policy_log_path(data_dir: Path, policy: str) -> Path:
    return data_dir / "logs" / f"train-{policy}.log"


class RunLog:
    """A training child's output, line by line, to the policy's log and (once its run is known) the run's."""

    def __init__(self, data_dir: Path, policy: str) -> None:
        self.data_dir = data_dir
        self.shared_path = policy_log_path(data_dir, policy)
        self._shared: IO[str] | None = None
        self._own: IO[str] | None = None
        self._pending: collections.deque[str] = collections.deque(maxlen=PENDING_LINES)

    def __enter__(self) -> RunLog:
        self.shared_path.parent.mkdir(parents=True, exist_ok=True)
        self._shared = self.shared_path.open("a", encoding="utf-8")
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        for handle in (self._shared, self._own):
            if handle is not None:
                handle.close()

    def write(self, line: str) -> None:
        assert self._shared is not None, "write within `with RunLog(...)`"
        self._shared.write(line)
        self._shared.flush()
        if self._own is None:
            self._pending.append(line)
        else:
            self._own.write(line)
            self._own.flush()

    def attach(self, run_id: int) -> None:
        """The child's run is known: its lines so far, and all after, go to its own file. A file of that run
        id left by a database since replaced (a restore) belongs to another run, and is overwritten."""
        if self._own is not None:
            return
        path = run_log_path(self.data_dir, run_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._own = path.open("w", encoding="utf-8")
        self._own.writelines(self._pending)
        self._own.flush()
        self._pending.clear()
