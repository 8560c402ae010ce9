"""Stopping a training command with a signal in the middle of its run, as a supervisor (SIGTERM) or a person
(Ctrl-C) does, and making sure that nothing it started outlives it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from tests.support.polling import wait_until
from tests.support.proc_stats import processes_with

REPO = Path(__file__).resolve().parents[2]


def ignore_sigint() -> None:
    """What a shell script does to the commands it starts in the background (`kaizen train &`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def default_sigint() -> None:
    """What a terminal's foreground job has, so Ctrl-C reaches it: SIGINT's default action. A child inherits an
    ignored SIGINT from the test runner when that was started in the background by a script (`make test &`),
    and a Ctrl-C test would then see its signal ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _as_launched(sigint_ignored: bool) -> Callable[[], None]:
    """SIGINT as `sigint_ignored` says, and SIGHUP at its default, as a training child's launcher leaves it
    (`dying_with_parent`) whatever the test runner's (`nohup` ignores it)."""

    def preexec() -> None:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        (ignore_sigint if sigint_ignored else default_sigint)()

    return preexec


@dataclass(frozen=True)
class Stopped:
    returncode: int
    output: str


def stop_mid_run(
    argv: Sequence[str],
    env: dict[str, str],
    signum: signal.Signals,
    log_path: Path,
    *,
    steps_log: Path | None = None,
    sigint_ignored: bool = False,
    start_timeout_s: float = 240,
    stdin: bytes | None = None,
    times: int = 1,
    victim: str | None = None,
) -> Stopped:
    """Start `argv` in a session of its own (its output to `log_path`, `stdin` on its input), wait for its first
    optimizer step in `steps_log` (default: its own output), send it `signum` (`times` times, 50 ms apart), and
    wait for it and for every process that shares its `KAIZEN_DATA_DIR` to exit; whatever is left is killed and
    fails the test. `victim`: the signal goes to the first process it started whose command line holds this
    instead."""
    steps = steps_log or log_path
    marker = f"KAIZEN_DATA_DIR={env['KAIZEN_DATA_DIR']}"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv,
            env=env,
            cwd=REPO,
            stdin=subprocess.PIPE if stdin is not None else None,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_as_launched(sigint_ignored),  # noqa: PLW1509 (no threads in the child yet)
        )
    if stdin is not None:
        assert process.stdin is not None
        process.stdin.write(stdin)
        process.stdin.close()
    try:
        wait_until(
            lambda: (steps.is_file() and "step 1/" in steps.read_text()) or process.poll() is not None,
            "the first optimizer step",
            timeout_s=start_timeout_s,
        )
        assert process.poll() is None, log_path.read_text()[-4000:]
        target = psutil.Process(process.pid)
        if victim is not None:
            matching = [p for p in target.children(recursive=True) if victim in " ".join(p.cmdline())]
            assert matching, f"no process started by {argv[:4]} runs {victim!r}"
            target = matching[0]
        for sent in range(times):
            if sent:
                time.sleep(0.05)  # apart, so that the signals are not merged into one while pending
            target.send_signal(signum)
        process.wait(timeout=180)
        wait_until(lambda: not processes_with(marker), "every process it started to exit", timeout_s=60)
    finally:
        kill_what_is_left(process, marker)
    return Stopped(process.returncode, log_path.read_text())


def kill_what_is_left(process: subprocess.Popen[Any], marker: str) -> None:
    """After a test: SIGKILL `process` if it still runs, and every process whose environment holds `marker`
    (`NAME=value`), so that nothing it started outlives the test, whatever failed."""
    if process.poll() is None:
        process.kill()
        process.wait()
    for pid in processes_with(marker):
        os.kill(pid, signal.SIGKILL)
