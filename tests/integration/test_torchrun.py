"""`python -m trainer.learner.torchrun`, the launcher of training on several processes: a run that ends by itself exits
with its trainer's status, and one stopped by a signal with 128 + the signal's number after one log line, with
every process it started stopped; neither prints torchrun's traceback."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.polling import wait_until
from tests.support.proc_stats import running
from tests.support.stopping import default_sigint

# torchrun (it imports torch) and its processes, stopped by signals: `make test-fast` leaves this module out.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

#: A training process stand-in: says it started (with its pid), then exits with the status it is given or waits
#: for a signal, which it takes as `python -m trainer.learner` does (no traceback of its own).
WORKER = """
import os, sys, time
from pathlib import Path

Path(sys.argv[1], os.environ["RANK"]).write_text(str(os.getpid()))
if len(sys.argv) > 2:
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


@pytest.mark.parametrize(
    "signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["sigterm", "ctrl-c", "parent-death-signal"]
)
def test_a_signal_stops_every_process_and_ends_in_a_log_line(tmp_path: Path, signum: signal.Signals) -> None:
    launcher = launch(tmp_path)
    try:
        started = tmp_path / "started"
        wait_until(
            lambda: len(list(started.iterdir())) == 2 or launcher.poll() is not None,
            "both processes to start",
            timeout_s=120,
        )
        assert launcher.poll() is None
        workers = [int(path.read_text()) for path in started.iterdir()]
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
