"""SIGTERM stops a command the way Ctrl-C does.

Kubernetes, torchrun, systemd and time limits stop a process with SIGTERM, whose default action ends it where it
stands: a training run stays `running` in `training_runs` for ever and the policy's job lock is held until its
time-to-live runs out. Turned into SIGINT, SIGTERM takes the path a person's Ctrl-C takes instead: `asyncio.run`
cancels its main task (or Python raises KeyboardInterrupt), the run is recorded as failed and the lock released,
and the command exits with 128 + the number of the signal that stopped it, as a shell reports one.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

Handler = Callable[[int, FrameType | None], Any] | int | None


class SigtermAsCtrlC:
    """While entered, SIGTERM (and each signal of `also` not ignored) is raised again as SIGINT, after `on_stop`
    has run; `signal` is the one that came (SIGINT until another does). A training child takes its parent-death
    signal (`trainer.control.child_processes.PARENT_DEATH_SIGNAL`) this way too, so its run records why it
    stopped.

    Only the first of them counts, and once one came the ones after it are ignored to the end of the process:
    Linux sends a child its parent-death signal once for each thread of the dying parent, and a second SIGINT
    would cut short the cleanup the first started (asyncio raises it at once), or the default action would end
    the process in the middle of it. A supervisor that insists sends SIGKILL."""

    def __init__(
        self, also: tuple[signal.Signals, ...] = (), on_stop: Callable[[signal.Signals], None] | None = None
    ) -> None:
        self.signal = signal.SIGINT
        self._handled = (signal.SIGTERM, *also)
        self._on_stop = on_stop
        self._previous: dict[signal.Signals, Handler] = {}

    def __enter__(self) -> SigtermAsCtrlC:
        for signum in self._handled:
            if signum != signal.SIGTERM and signal.getsignal(signum) == signal.SIG_IGN:
                continue  # ignored on purpose (`nohup` ignores SIGHUP): it stays so
            self._previous[signum] = signal.signal(signum, self._terminate)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        stopping = self.signal != signal.SIGINT
        for signum, previous in self._previous.items():
            signal.signal(signum, signal.SIG_IGN if stopping else previous)

    def _terminate(self, signum: int, frame: FrameType | None) -> None:
        if self.signal != signal.SIGINT:
            return  # already stopping on one
        self.signal = signal.Signals(signum)
        if self._on_stop is not None:
            self._on_stop(self.signal)
        if not callable(signal.getsignal(signal.SIGINT)):
            # SIGINT ignored (a shell script's background job) or left to the system: stop all the same.
            raise KeyboardInterrupt
        signal.raise_signal(signal.SIGINT)

    @property
    def exit_status(self) -> int:
        return 128 + self.signal
