"""The model-job protocol, with real child processes (small scripts, no torch): the job on stdin, the log on
stderr forwarded as records, the refusal's reason on stdout, exit statuses, and a cancelled job's child."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.support.polling import wait_until, wait_until_async
from tests.support.proc_stats import running
from trainer.control.model_jobs import (
    BASE_MODEL_UNAVAILABLE,
    DONE,
    LINE_CHARS,
    TAIL_LINES,
    GgufConversionJob,
    ModelJobFailed,
    ModelJobOutcome,
    run_model_job,
    run_model_job_sync,
)

#: A child that speaks the protocol: reads its job, logs, prints (as a library would), then does what the job's
#: `gguf` field says.
_CHILD = textwrap.dedent(
    """
    import logging, os, signal, sys, time
    from pathlib import Path
    from trainer.control.model_jobs import (
        BASE_MODEL_UNAVAILABLE, DONE, GgufConversionJob, configure_child_logging, read_job, take_result_channel,
    )

    result = take_result_channel()
    job = read_job(GgufConversionJob)
    configure_child_logging(job.log_level)
    log = logging.getLogger("child.job")
    log.info("template of %d characters", len(job.chat_template))
    print("printed by a library")
    action = job.gguf
    if action == "refuse":
        log.warning("first line\\nsecond line")
        result.write("no model at that path\\n")
        sys.exit(BASE_MODEL_UNAVAILABLE)
    if action == "fail":
        for number in range(30):
            log.info("step %d", number)
        raise RuntimeError("the conversion broke")
    if action == "long-line":
        log.info("x" * 100_000)
    if action == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "hang":
        written = Path(job.out_dir + ".partial")
        written.write_text(str(os.getpid()))
        written.rename(job.out_dir)
        while True:
            time.sleep(1)
    sys.exit(DONE)
    """
)
COMMAND = (sys.executable, "-c", _CHILD)
REPO = Path(__file__).resolve().parents[2]


def job(action: str, template: str = "{{ messages }}", out_dir: str = "") -> GgufConversionJob:
    return GgufConversionJob(gguf=action, out_dir=out_dir, chat_template=template, log_level=logging.INFO)


def run(mode: str, command: Sequence[str], model_job: GgufConversionJob) -> ModelJobOutcome:
    """The job through the async launcher (on an event loop) or the sync one."""
    if mode == "async":
        return asyncio.run(run_model_job(command, model_job, "the test job"))
    return run_model_job_sync(command, model_job, "the test job")


MODES = pytest.mark.parametrize("mode", ["async", "sync"])


@MODES
def test_a_job_of_a_megabyte_reaches_the_child_whole_and_its_log_is_forwarded(
    mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)

    outcome = run(mode, COMMAND, job("done", template="t" * 2**20))

    assert outcome == ModelJobOutcome(DONE, "")
    records = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    assert ("child.job", logging.INFO, f"template of {2**20} characters") in records
    # What a library prints goes to the log, never to the result channel.
    assert ("child.job", logging.INFO, "printed by a library") in records


@MODES
def test_a_refusal_gives_its_reason_and_continuation_lines_keep_their_record_level(
    mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)

    outcome = run(mode, COMMAND, job("refuse"))

    assert outcome == ModelJobOutcome(BASE_MODEL_UNAVAILABLE, "no model at that path")
    records = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    assert ("child.job", logging.WARNING, "first line") in records
    assert ("child.job", logging.WARNING, "second line") in records


@MODES
def test_a_failed_child_is_an_error_quoting_its_last_log_lines(mode: str) -> None:
    with pytest.raises(
        ModelJobFailed, match="the test job failed: its process exited with status 1"
    ) as failed:
        run(mode, COMMAND, job("fail"))

    message = str(failed.value)
    assert "RuntimeError: the conversion broke" in message
    assert "step 29" in message and "step 0\n" not in message  # the last lines only
    assert len(message.splitlines()) == TAIL_LINES + 1


@MODES
def test_a_child_killed_by_a_signal_is_an_error_that_says_so(mode: str) -> None:
    with pytest.raises(ModelJobFailed, match="was killed by signal 9"):
        run(mode, COMMAND, job("killed"))


@MODES
def test_a_child_that_cannot_start_is_an_error_with_its_output(mode: str) -> None:
    with pytest.raises(ModelJobFailed, match="No module named 'no_such_module_here'"):
        run(mode, (sys.executable, "-c", "import no_such_module_here"), job("done"))


def test_a_very_long_log_line_is_cut(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)

    run("async", COMMAND, job("long-line"))

    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("xxx")]
    assert len(line) < LINE_CHARS


def test_a_cancelled_job_kills_its_child(tmp_path: Path) -> None:
    """A request cancelled while version 0 is built (the gateway shuts down) leaves no child behind."""
    pid_file = tmp_path / "pid"

    async def started() -> bool:
        return pid_file.exists()

    async def cancel_midway() -> int:
        task = asyncio.create_task(run_model_job(COMMAND, job("hang", out_dir=str(pid_file)), "the test job"))
        await wait_until_async(started, "the child to start")
        pid = int(pid_file.read_text())
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return pid

    pid = asyncio.run(cancel_midway())

    assert not running(pid)


@MODES
def test_a_sigkilled_caller_takes_its_jobs_child_with_it(tmp_path: Path, mode: str) -> None:
    """A gateway or command SIGKILLed while it waits for a model job (version 0's build, a base model's
    conversion) leaves no child behind holding a model's memory; either launcher, since the sync one waits in
    whatever thread called it."""
    pid_file = tmp_path / "pid"
    caller = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from tests.unit.test_model_jobs import COMMAND, job, run; "
            "run(sys.argv[1], COMMAND, job('hang', out_dir=sys.argv[2]))",
            mode,
            str(pid_file),
        ],
        cwd=REPO,
    )
    try:
        wait_until(lambda: pid_file.exists() or caller.poll() is not None, "the child to start")
        assert caller.poll() is None
        child = int(pid_file.read_text())
        caller.kill()
        caller.wait()
        wait_until(lambda: not running(child), "the child to exit after its caller", timeout_s=30)
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.wait()
        if pid_file.exists() and running(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
