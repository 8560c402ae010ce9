"""The one typed configuration a training child is started with: `python -m trainer.learner` reads it as one JSON
line on its stdin, as the capture writer reads its own.

The control plane builds it (the scheduler's job runner, `kaizen train`) from the process settings and the run's
own choices; the learner never reads `KAIZEN_*` variables or flags. Secrets (the database URL's password, the
judge's key, the key that authorises resampling through the gateway, the webhook secret) travel here, never in
argv, which every user of the machine can read in `ps`. Under torchrun every training process inherits the same
stdin; only rank 0 reads it, the others receive what they need from rank 0.
"""

from __future__ import annotations

import contextlib
import signal
from datetime import datetime
from typing import Any

import msgspec

from trainer.control.ruler import JudgeSettings

#: Exit status of a training child whose run ended without a candidate (skipped or failed).
NO_CANDIDATE = 3
#: Exit status of a training child that could not read its job (no or malformed stdin).
BAD_JOB = 2


def exit_error(status: int | None, tail: str = "") -> str:
    """The error of a run whose training child ended without recording an outcome: what it died of (a signal
    says so, rather than leaving the reader with whatever line its log had reached), then its last log lines."""
    said = f"training process exited with {status}"
    if status is not None and status < 0:
        with contextlib.suppress(ValueError):
            said = f"training process killed by {signal.Signals(-status).name}"
    return f"{said}; its log ended:\n{tail}" if tail else said


class TrainingJob(msgspec.Struct, frozen=True, kw_only=True):
    """Everything one training run of a policy needs."""

    policy: str
    #: Async SQLAlchemy URL of the database the run reads episodes from and records itself in.
    database_url: str
    #: Where adapters and logs are written (the gateway's data directory).
    data_dir: str
    #: Local directory (or Hugging Face id) of the policy's base model, resolved by the parent.
    base_model: str
    judge: JudgeSettings
    #: Signs calls to the policy's scoring webhook.
    webhook_secret: str = ""
    #: The gateway's OpenAI URL (ending in /v1) `resample` grouping samples through; None: the trainer's own model.
    engine_url: str | None = None
    engine_api_key: str | None = None
    #: The gateway's largest `n`: larger groups are requested in several calls.
    engine_max_n: int = 16
    #: `TrainConfig` keys overriding the policy's stored `train` configuration for this run.
    overrides: dict[str, Any] = msgspec.field(default_factory=dict)
    #: Train on episodes since this time (default: since the last run's data ended).
    since: datetime | None = None
    #: torch device (default: cuda when available, else cpu).
    device: str | None = None
    #: The job lock owner the run trains under (its parent holds the lock: the scheduler's job, `kaizen train`);
    #: None: take the lock itself.
    lock_owner: str | None = None
    log_level: str = "info"

    def encode(self) -> bytes:
        """The job as the line the child reads."""
        return msgspec.json.encode(self) + b"\n"


def decode_job(line: bytes) -> TrainingJob:
    """Read a job line; raises `msgspec.DecodeError` / `msgspec.ValidationError` naming what is wrong."""
    return msgspec.json.decode(line, type=TrainingJob)
