"""`python -m trainer.learner.torchrun`, the launcher of training on several processes: a run that ends by itself exits
with its trainer's status, and one stopped by a signal with 128 + the signal's number after one log line, with
every process it started stopped; neither prints torchrun's traceback. A launcher killed outright takes its
processes with it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.polling import wait_until
from tests.support.proc_stats import running
from tests.support.stopping import default_sigint
from trainer.learner.torchrun import LAUNCHER_PID

# torchrun (it imports torch) and its processes, stopped by signals: `make test-fast` leaves this module out.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

#: A training process stand-in: asks to die with torchrun and says it started (with its pid), then exits with the
#: status it is given (only on the rank given after it, if one is) or waits for a signal, which it takes as
#: `python -m trainer.learner` does (no traceback of its own).
WORKER = """
import os, sys, time
from pathlib import Path
from trainer.learner.torchrun import die_with_launcher

die_with_launcher()
Path(sys.argv[1], os.environ["RANK"]).write_text(str(os.getpid()))
if len(sys.argv) > 2 and sys.argv[3:] in ([], [os.environ["RANK"]]):
    status = int(sys.argv[2])
    if status < 0:
        os.kill(os.getpid(), -status)
    sys.exit(status)
try:
    time.sleep(600)
except KeyboardInterrupt:
    sys.exit(130)
"""


def launch(tmp_path: Path, *worker_args: str) -> subprocess.Popen[str]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    (tmp_path / "started").mkdir()
    command = [
        sys.executable, "-m", "trainer.learner.torchrun", "--standalone", "--nproc-per-node", "2",
        str(script), str(tmp_path / "started"), *worker_args,
    ]  # fmt: skip
    return subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=default_sigint,  # noqa: PLW1509 (no threads in the child yet)
    )


def started_workers(tmp_path: Path, launcher: subprocess.Popen[str]) -> list[int]:
    """The pids of both training processes, once they said they started."""
    started = tmp_path / "started"
    wait_until(
        lambda: len(list(started.iterdir())) == 2 or launcher.poll() is not None,
        "both processes to start",
        timeout_s=120,
    )
    assert launcher.poll() is None
    return [int(path.read_text()) for path in started.iterdir()]


@pytest.mark.parametrize(
    "signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["sigterm", "ctrl-c", "parent-death-signal"]
)
def test_a_signal_stops_every_process_and_ends_in_a_log_line(tmp_path: Path, signum: signal.Signals) -> None:
    launcher = launch(tmp_path)
    try:
        workers = started_workers(tmp_path, launcher)
        launcher.send_signal(signum)
        output, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 128 + signum, output[-4000:]
    assert f"torchrun stopped by {signum.name}" in output, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    wait_until(
        lambda: not any(running(pid) for pid in workers), "the training processes to exit", timeout_s=30
    )


@pytest.mark.parametrize(
    ("status", "expected"),
    [(0, 0), (3, 3), (-signal.SIGKILL, 128 + signal.SIGKILL)],
    ids=["succeeded", "skipped-or-failed", "killed"],
)
def test_a_run_that_ends_by_itself_exits_with_its_trainers_status(
    tmp_path: Path, status: int, expected: int
) -> None:
    """As `python -m trainer.learner` would on one process; a failure is torchrun's summary, not a traceback."""
    launcher = launch(tmp_path, str(status))
    output, _ = launcher.communicate(timeout=180)
    assert launcher.returncode == expected, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    if status != 0:
        assert "Root Cause (first observed failure)" in output, output[-4000:]


def test_the_first_trainer_to_fail_sets_the_status_not_one_torchrun_stopped(tmp_path: Path) -> None:
    """When one process fails, torchrun stops the others (SIGTERM): the launcher exits with the failed one's
    status, not with the 143 of a rank 0 that torchrun stopped."""
    launcher = launch(tmp_path, "3", "1")  # rank 1 exits 3; rank 0 trains on until torchrun stops it
    output, _ = launcher.communicate(timeout=180)
    assert "closing signal SIGTERM" in output, output[-4000:]
    assert launcher.returncode == 3, output[-4000:]


def test_a_killed_launcher_takes_its_processes_with_it(tmp_path: Path) -> None:
    """torchrun starts each process in a session of its own, out of reach of a SIGKILL to its group: each gets a
    SIGKILL from Linux when torchrun dies instead (`die_with_launcher`)."""
    launcher = launch(tmp_path)
    workers: list[int] = []
    try:
        workers = started_workers(tmp_path, launcher)
        assert {os.getsid(pid) for pid in workers}.isdisjoint({os.getsid(launcher.pid)})
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=60)
        wait_until(
            lambda: not any(running(pid) for pid in workers), "the training processes to exit", timeout_s=30
        )
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in workers:  # what a failure left
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_process_whose_launcher_is_already_gone_ends_at_once() -> None:
    """torchrun may die between starting a process and the process's request: it then ends by itself."""
    code = "from trainer.learner.torchrun import die_with_launcher; die_with_launcher(); print('alive')"
    for launcher_pid, expected in ((os.getpid(), 0), (1, -signal.SIGKILL)):
        done = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, LAUNCHER_PID: str(launcher_pid)},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == expected, done.stderr
        assert ("alive" in done.stdout) == (expected == 0)
