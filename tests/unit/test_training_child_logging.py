"""The training child's log says what the run did: no line per HTTP request (resampling and the gate send
thousands of them), whatever level the job asks for."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHILD = """
import logging, sys
from trainer.learner.train_command import configure_logging

configure_logging(sys.argv[1])
logging.getLogger("httpx").info("HTTP Request: POST http://engine/v1/completions 200 OK")
logging.getLogger("httpx").warning("a request failed")
logging.getLogger("trainer.learner.grpo").info("step 1/12")
"""


@pytest.mark.parametrize("level", ["info", "debug"])
def test_the_training_child_logs_no_line_per_request(level: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, level], capture_output=True, text=True, timeout=120, check=True
    )
    assert "step 1/12" in done.stderr and "a request failed" in done.stderr
    assert "HTTP Request" not in done.stderr
