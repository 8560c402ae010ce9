"""`python -m trainer.learner`: one training run of a policy, the process the scheduler and `kaizen train` start.

It reads one `trainer.control.training_job.TrainingJob` as a JSON line on stdin and nothing else: no flags, no
`KAIZEN_*` variables. Exit status: 0 when a candidate version was written, 3 (`NO_CANDIDATE`) when the run was
skipped or failed, 2 (`BAD_JOB`) when the job could not be read, 128 + n when signal n stopped it. Under torchrun
(`trainer.learner.torchrun`) every process runs this module; rank 0 reads the job and is the run, the others
follow it (`trainer.learner.distributed`).
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from migrations.runner import upgrade_database
from storage.database import Database
from storage.policies import get_policy
from trainer.control.child_processes import PARENT_DEATH_SIGNAL
from trainer.control.launch import Ranks, ranks_from_environment
from trainer.control.rewards import policy_reward_config
from trainer.control.run_logs import policy_log_path
from trainer.control.scoring import Scorer
from trainer.control.signals import SigtermAsCtrlC
from trainer.control.training_job import BAD_JOB, NO_CANDIDATE, TrainingJob, decode_job
from trainer.learner.engine_sampling import EngineEndpoint
from trainer.learner.grouping import PolicyReplyScorer
from trainer.learner.job import TrainOutcome, TrainRequest, run_training
from trainer.learner.torchrun import die_with_launcher

if TYPE_CHECKING:
    from trainer.learner.distributed import Followers

log = logging.getLogger(__name__)

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


async def train_policy(
    job: TrainingJob, interrupt: SigtermAsCtrlC | None = None, followers: Followers | None = None
) -> TrainOutcome:
    """Run one training run. `interrupt`: the command's signal handling, which says what stopped it; `followers`:
    this is rank 0 of several training processes (torchrun)."""
    await upgrade_database(job.database_url)
    database = Database(job.database_url)
    try:
        async with database.session() as session:
            policy = await get_policy(session, job.policy)
            if policy is None:
                raise ValueError(f"unknown policy {job.policy!r}")
            reward_config = await policy_reward_config(session, job.policy)
        scorer = Scorer(reward_config, job.judge, webhook_secret=job.webhook_secret)
        engine = None
        if job.engine_url:
            engine = EngineEndpoint(job.engine_url, job.engine_api_key, max_n=job.engine_max_n)
        request = TrainRequest(
            policy=job.policy,
            data_dir=Path(job.data_dir),
            base_model_path=job.base_model,
            overrides=dict(job.overrides),
            since=job.since,
            scorer=PolicyReplyScorer(scorer, job.policy),
            sampler=engine,
            device=job.device,
            followers=followers,
            lock_owner=job.lock_owner,
            interrupt=interrupt,
        )
        async with scorer:
            outcome = await run_training(database, request)
    finally:
        await database.dispose()
    log.info("training run %d: %s %s", outcome.run_id, outcome.status, outcome.adapter_path or outcome.error)
    return outcome


def configure_logging(level: str) -> None:
    """Log to stderr (the scheduler writes it to the run's log) at `level`, without a line per HTTP request:
    resampling and the gate send thousands, which would bury what the run did."""
    logging.basicConfig(level=level.upper(), format=_FORMAT, stream=sys.stderr)
    for name in ("httpx", "httpx2"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))


def main() -> int:
    """Read the job (rank 0) and run it; see the module docstring for the exit statuses.

    A process of a torchrun group does not return: it ends with `os._exit` once its log is flushed. FSDP's device
    mesh keeps the process group, and so gloo's worker threads, alive past `destroy_process_group`; an
    interpreter torn down under them crashed a rank at exit now and then (SIGSEGV in `pt_gloo_runloop`, which
    made torchrun report a finished run as failed) or left it hanging."""
    faulthandler.enable()  # a crash in torch's or gloo's native code leaves the Python stacks in the run's log
    ranks = ranks_from_environment()
    if ranks is None:
        return _run(None)
    try:
        status = _run(ranks)
    except BaseException:
        traceback.print_exc()  # as the interpreter would print it, with its exit status below
        status = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _run(ranks: Ranks | None) -> int:
    die_with_launcher()
    if ranks is not None and not ranks.main:
        configure_logging("info")
        return _follow(ranks)
    try:
        job = decode_job(sys.stdin.buffer.readline())
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        configure_logging("info")
        log.error("no training job on stdin (one TrainingJob as a JSON line): %s", exc)
        return BAD_JOB
    configure_logging(job.log_level)
    placement = [
        f"{name}={os.environ[name]}"
        for name in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")
        if name in os.environ
    ]
    if placement:
        log.info("training %s with %s", job.policy, " ".join(placement))
    with SigtermAsCtrlC(also=(PARENT_DEATH_SIGNAL,), on_stop=_orphaned_logs_to_policy_log(job)) as interrupt:
        try:
            return _train(job, interrupt, ranks)
        except KeyboardInterrupt:
            log.error("training stopped by %s", interrupt.signal.name)
            return interrupt.exit_status


def _orphaned_logs_to_policy_log(job: TrainingJob) -> Callable[[signal.Signals], None]:
    """On the parent-death signal: a gateway's training child logs through the gateway, which is gone, so from then
    on the log lines go to the policy's log (`trainer.control.run_logs`) directly: those that say how the run ended
    are kept."""

    def on_stop(signum: signal.Signals) -> None:
        if signum != PARENT_DEATH_SIGNAL:
            return
        to_stderr = [
            handler
            for handler in logging.getLogger().handlers
            if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stderr
        ]
        if not to_stderr:
            return
        try:
            log_file = policy_log_path(Path(job.data_dir), job.policy).open("a", encoding="utf-8")
        except OSError:  # raised here, in a signal handler, it would break off whatever the run was doing
            return
        for handler in to_stderr:
            handler.setStream(log_file)

    return on_stop


def _train(job: TrainingJob, interrupt: SigtermAsCtrlC, ranks: Ranks | None) -> int:
    if ranks is None:
        outcome = asyncio.run(train_policy(job, interrupt))
        return 0 if outcome.status == "succeeded" else NO_CANDIDATE
    # Rank 0 of several processes started by torchrun (see trainer/learner/distributed.py).
    from trainer.learner.distributed import Followers, start, stop

    start(ranks)
    try:
        followers = Followers(ranks)
        try:
            outcome = asyncio.run(train_policy(job, interrupt, followers))
        finally:
            followers.release()
        return 0 if outcome.status == "succeeded" else NO_CANDIDATE
    finally:
        stop()


def _follow(ranks: Ranks) -> int:
    """A training process other than rank 0: it reads no job and trains what rank 0 hands it."""
    from trainer.learner.distributed import start, stop
    from trainer.learner.job import follow

    with SigtermAsCtrlC(also=(PARENT_DEATH_SIGNAL,)) as interrupt:
        try:
            start(ranks)
            try:
                follow(ranks)
            finally:
                stop()
        except KeyboardInterrupt:
            log.error("training stopped by %s", interrupt.signal.name)
            return interrupt.exit_status
    return 0
