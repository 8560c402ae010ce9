"""Model jobs: the torch work the serving side needs, each done by a child process of its own.

Two jobs need a model loaded with torch: building version 0 of a new policy (`trainer.learner.initial_adapter`)
and converting an embedded GGUF into a Hugging Face directory (`trainer.learner.gguf_conversion`). The serving
process starts them and waits; torch, transformers and the model's weights (gigabytes for a 7B base) live in
the child and are returned to the system when it exits.

The protocol of such a child, `python -m <module>`:

* stdin: its job, one JSON document (a Struct below). Never argv: `ps` shows argv to every user, and a chat
  template is kilobytes.
* stderr: its log, one record a line as `LEVEL logger: message`. The parent logs each record under the same
  logger and level; a line that is no record (a traceback's) goes with the record before it. The parent keeps
  the last lines for the error it raises when the child fails.
* stdout: only the one-line reason of `BASE_MODEL_UNAVAILABLE`. The child points its file descriptor 1 at
  stderr as it starts, so whatever a library prints lands in the log.
* exit status: `DONE`, `FAILED` (the log says why) or `BASE_MODEL_UNAVAILABLE`.

Both ends live here, without torch: the gateway imports the Structs and the launchers, the children the
Structs and the child-side helpers.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import subprocess
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any, TypeVar

import msgspec

from trainer.control.child_processes import dying_with_parent, own_modules_environment

log = logging.getLogger(__name__)

#: Exit statuses of a model job.
DONE = 0
FAILED = 1
BASE_MODEL_UNAVAILABLE = 2

#: Log lines of a failed child quoted in the error raised for it.
TAIL_LINES = 20
#: Longest log line forwarded as it is; a longer one (a loader echoing a 70 kB model name) is cut.
LINE_CHARS = 4000
#: Longest reason a child gives for `BASE_MODEL_UNAVAILABLE`.
REASON_CHARS = 300

_RECORD = re.compile(r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) ([^\s:]+): (.*)", re.DOTALL)
_CHUNK = 1 << 16


class InitialAdapterJob(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Build version 0 of a policy: a fresh LoRA on `base_model`, saved at `target`."""

    base_model: str  # a local model directory or a Hugging Face id (an embedded name is resolved before)
    target: str  # the adapter directory to create, renamed into place once complete
    train: dict[str, Any]  # the policy's `train` section (`TrainConfig`): the LoRA's shape and seed
    log_level: int = logging.INFO


class GgufConversionJob(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Dequantise the GGUF at `gguf` into a bf16 Hugging Face model in `out_dir` (which exists), with
    `chat_template` as its tokenizer's template, and check it still generates as the GGUF does."""

    gguf: str
    out_dir: str
    chat_template: str
    log_level: int = logging.INFO


ModelJob = InitialAdapterJob | GgufConversionJob
Job = TypeVar("Job", InitialAdapterJob, GgufConversionJob)


class ModelJobFailed(RuntimeError):
    """A model job's child ended other than as its protocol says; the message quotes its last log lines."""


@dataclass(frozen=True)
class ModelJobOutcome:
    status: int  # `DONE` or `BASE_MODEL_UNAVAILABLE`: any other status raises `ModelJobFailed`
    reason: str  # what the child gave on stdout (the reason of `BASE_MODEL_UNAVAILABLE`), else ""


def module_command(module: str) -> tuple[str, ...]:
    """`python -m module` with this interpreter: the child has the packages the parent has."""
    return (sys.executable, "-m", module)


def clip(text: str, limit: int = REASON_CHARS) -> str:
    """At most `limit` characters of `text`: a loader echoes a 70 kB model name back, and so would a 400."""
    return text if len(text) <= limit else text[:limit] + "..."


# ---------------------------------------------------------------------------------------------- the parent's side
class _LogForwarder:
    """Turns the child's stderr into log records of this process, and keeps its last lines."""

    def __init__(self) -> None:
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._partial = b""
        self._logger = log
        self._level = logging.INFO

    def feed(self, chunk: bytes) -> None:
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        for line in lines:
            self._forward(line)

    def close(self) -> None:
        if self._partial:
            self._forward(self._partial)
            self._partial = b""

    def _forward(self, raw: bytes) -> None:
        line = clip(raw.decode(errors="replace").rstrip("\r"), LINE_CHARS)
        if not line.strip():
            return
        self.tail.append(line)
        record = _RECORD.fullmatch(line)
        if record is None:
            self._logger.log(self._level, "%s", line)
            return
        level, name, message = record.groups()
        self._logger, self._level = logging.getLogger(name), logging.getLevelNamesMapping()[level]
        self._logger.log(self._level, "%s", message)


def _outcome(what: str, status: int, stdout: bytes, forwarder: _LogForwarder) -> ModelJobOutcome:
    if status in (DONE, BASE_MODEL_UNAVAILABLE):
        return ModelJobOutcome(status, clip(stdout.decode(errors="replace").strip()))
    ended = f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"
    lines = "\n".join(forwarder.tail) or "(it logged nothing)"
    raise ModelJobFailed(f"{what} failed: its process {ended}; its last log lines:\n{lines}")


async def run_model_job(command: Sequence[str], job: ModelJob, what: str) -> ModelJobOutcome:
    """Start `command` (a model job's child), hand it `job` and wait for it, logging its log as it comes; the event
    loop goes on serving meanwhile. Cancelled, it kills the child. `what` names the job in an error."""
    process = await asyncio.create_subprocess_exec(
        *dying_with_parent(command),  # no orphan holding a model's memory after a SIGKILLed gateway
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=own_modules_environment(),
    )
    assert process.stdin is not None and process.stdout is not None and process.stderr is not None
    forwarder = _LogForwarder()
    stdout = asyncio.ensure_future(process.stdout.read())
    try:
        try:
            process.stdin.write(msgspec.json.encode(job))
            await process.stdin.drain()
            process.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass  # it exited before reading its job: its status and log say why
        while chunk := await process.stderr.read(_CHUNK):
            forwarder.feed(chunk)
        forwarder.close()
        status = await process.wait()
        result = await stdout
    except BaseException:
        stdout.cancel()
        if process.returncode is None:
            process.kill()
            await process.wait()
        raise
    return _outcome(what, status, result, forwarder)


def run_model_job_sync(command: Sequence[str], job: ModelJob, what: str) -> ModelJobOutcome:
    """`run_model_job` for a caller without an event loop (the base model's pull, under its file lock)."""
    forwarder = _LogForwarder()
    with subprocess.Popen(
        # As `run_model_job`'s: no orphan after a SIGKILLed caller. The signal is tied to the calling thread, which
        # waits here for the child, so it cannot go first.
        dying_with_parent(command),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=own_modules_environment(),
    ) as process:
        assert process.stdin is not None and process.stdout is not None and process.stderr is not None
        try:
            try:
                process.stdin.write(msgspec.json.encode(job))
                process.stdin.close()
            except BrokenPipeError:
                pass  # it exited before reading its job: its status and log say why
            # stdout carries at most one short line (fd 1 points at stderr in the child), so reading stderr to
            # its end first cannot block the child on a full stdout pipe.
            while chunk := os.read(process.stderr.fileno(), _CHUNK):
                forwarder.feed(chunk)
            forwarder.close()
            result = process.stdout.read()
            status = process.wait()
        except BaseException:
            process.kill()
            raise
    return _outcome(what, status, result, forwarder)


# ----------------------------------------------------------------------------------------------- the child's side
def take_result_channel() -> IO[str]:
    """stdout, kept for the child's result; file descriptor 1 then points at stderr, so that what a library
    prints (to `sys.stdout` or from C) goes to the log. Called first thing in a child's `main`."""
    sys.stdout.flush()
    result = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    return result


def read_job(job_type: type[Job]) -> Job:
    """The child's job, from stdin."""
    return msgspec.json.decode(sys.stdin.buffer.read(), type=job_type)


def configure_child_logging(level: int) -> None:
    """Log records to stderr in the form the parent forwards (`LEVEL logger: message`), with no progress bars."""
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s", force=True
    )
    os.environ["TQDM_DISABLE"] = "1"
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
