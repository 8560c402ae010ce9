"""`kaizen demo` stopped by a signal: Ctrl-C in its terminal (SIGINT to the whole foreground process group, the
gateway it started included) or SIGTERM from a supervisor or a time limit (to the demo alone). Either way the
gateway stops, the cycles measured so far are kept in `demo.json` and `demo.png`, and the command exits with
128 + the signal's number and a log line, not a traceback."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.demo_process import CYCLE_CALLS
from tests.support.polling import wait_until
from tests.support.proc_stats import child_pids, running
from tests.support.scripted_upstream import ScriptedUpstream
from tests.support.stopping import default_sigint

# A demo with its own gateway, stopped by a signal, three times: `make test-fast` leaves it out.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def report(out: Path) -> dict[str, Any] | None:
    """`demo.json` once it is written whole (it is rewritten after every cycle)."""
    with contextlib.suppress(OSError, ValueError):
        loaded: dict[str, Any] = json.loads((out / "demo.json").read_text())
        return loaded
    return None


def serving_children(pid: int) -> list[int]:
    """The demo's `kaizen serve` children."""
    found = []
    for child in child_pids(pid):
        with contextlib.suppress(OSError):
            if b"serve" in Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0"):
                found.append(child)
    return found


@pytest.mark.parametrize(
    ("signum", "whole_group", "presses"),
    [(signal.SIGINT, True, 1), (signal.SIGINT, True, 2), (signal.SIGTERM, False, 1)],
    ids=["ctrl-c", "ctrl-c-twice", "sigterm"],
)
def test_a_signal_ends_the_demo_with_its_report_and_no_traceback(
    tmp_path: Path,
    upstream: ScriptedUpstream,
    embedded_model: Path,
    signum: signal.Signals,
    whole_group: bool,
    presses: int,
) -> None:
    out = tmp_path / "out"
    log_path = tmp_path / "demo.log"
    command = [sys.executable, "-m", "tests.support.demo_process", str(out), upstream.url]
    with log_path.open("wb") as log_file:
        demo = subprocess.Popen(
            [*command, str(embedded_model.parent)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=log_file,
            start_new_session=True,  # its own process group, as a terminal gives a foreground job
            preexec_fn=default_sigint,  # noqa: PLW1509 (no threads in the child yet)
        )
    try:

        def a_cycle_is_reported() -> bool:
            written = report(out)
            return demo.poll() is not None or (written is not None and len(written["cycles"]) >= 1)

        wait_until(a_cycle_is_reported, "the demo's first cycle", timeout_s=240)
        assert demo.poll() is None, log_path.read_text()[-3000:]
        [gateway] = serving_children(demo.pid)
        for press in range(presses):
            if press:  # again, impatiently, while the demo stops its gateway
                wait_until(
                    lambda: "stopping the gateway" in log_path.read_text(), "the demo to start stopping"
                )
            if whole_group:
                os.killpg(demo.pid, signum)
            else:
                demo.send_signal(signum)
        stdout, _ = demo.communicate(timeout=150)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
    log = log_path.read_text()
    assert demo.returncode == 128 + signum, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert f"{signum.name}: ending the demo" in log
    assert (f"{signum.name}: already stopping" in log) == (presses > 1)
    assert not running(gateway), "the demo's gateway outlived it"
    written = report(out)
    assert written is not None
    assert written["summary"]["stopped_by"] == signum.name
    assert written["cycles"] and all(c["n_calls"] == CYCLE_CALLS for c in written["cycles"])
    assert (out / "demo.png").stat().st_size > 0
    assert json.loads(stdout) == written["summary"]["targets"]
