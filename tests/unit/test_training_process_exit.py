"""How a training process ends: under torchrun it leaves with `os._exit`, not through the interpreter's shutdown,
which gloo's threads (alive past `destroy_process_group` under FSDP) crashed now and then."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.learner import train_command

REPO = Path(__file__).resolve().parents[2]

# A run that leaves a thread behind that never ends: a stand-in for gloo's, which the interpreter's shutdown would
# wait for here (a Python thread) and ran under there (native ones).
_RANK_WITH_A_THREAD_LEFT = """
import logging, sys, threading
from trainer.learner import train_command

def run(ranks):
    train_command.configure_logging("info")
    threading.Thread(target=threading.Event().wait, name="left-behind").start()
    logging.getLogger("trainer.learner.job").error("the run's last line")
    print("buffered output", end="")
    if sys.argv[1] == "raise":
        raise RuntimeError("the run broke")
    return int(sys.argv[1])

train_command._run = run
raise SystemExit(train_command.main())
"""


def rank_process(outcome: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}
    return subprocess.run(
        [sys.executable, "-c", _RANK_WITH_A_THREAD_LEFT, outcome],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("status", [0, 143])
def test_a_torchrun_rank_exits_with_its_status_and_its_log_whatever_threads_are_left(status: int) -> None:
    ended = rank_process(str(status))
    assert ended.returncode == status, ended.stderr
    assert "the run's last line" in ended.stderr
    assert ended.stdout == "buffered output"


def test_a_torchrun_rank_whose_run_raises_prints_the_traceback_and_exits_1() -> None:
    ended = rank_process("raise")
    assert ended.returncode == 1, ended.stderr
    assert "Traceback" in ended.stderr and "RuntimeError: the run broke" in ended.stderr
    assert "the run's last line" in ended.stderr


def test_a_process_alone_returns_its_status(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(train_command, "_run", lambda ranks: 3)
    assert train_command.main() == 3
