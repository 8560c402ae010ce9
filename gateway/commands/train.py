"""`kaizen train --policy P`: one GRPO run of a policy now, in the foreground.

It starts exactly the training child the scheduler starts (`python -m trainer.learner`, through torchrun when
`KAIZEN_TRAIN_PROCESSES` > 1) with the same `TrainingJob` on its stdin, shows its log, and exits with its status:
0 when a candidate version was written, 3 when the run was skipped or failed (or another job of the policy
holds its lock: refused before the child starts). The candidate is not gated or promoted (`kaizen policy
promote`, or let the schedule's run do it). `--print-job` prints the job instead, for launchers of one's own
(several machines through torchrun: docker/train-*.yaml).

It holds the policy's job lock for its child, as the scheduler does: a child killed before it could record its
run (the out-of-memory killer's pick) leaves the run for this process to mark failed and the lock for it to
release, at once, instead of a run `running` until the policy's next job and a policy locked for `lock_ttl_s`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from gateway.commands.options import add_common_options, configure_logging, load_settings, parse_since
from trainer.control.child_processes import PARENT_DEATH_SIGNAL, dying_with_parent

if TYPE_CHECKING:
    from storage.policies import PolicyInfo
    from trainer.control.training_job import TrainingJob

log = logging.getLogger("kaizen")


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    train = commands.add_parser(
        "train",
        help="Train a policy once with GRPO on its rewarded episodes; writes version N+1 (candidate).",
    )
    train.add_argument("--policy", required=True, help="Policy to train.")
    train.add_argument(
        "--since", help="Only episodes created since (24h, 7d, ISO); default: since the last run."
    )
    train.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Override a TrainConfig field for this run (VALUE is JSON where it parses, else a string).",
    )
    train.add_argument("--device", help="torch device (default: cuda when available, else cpu).")
    train.add_argument(
        "--print-job",
        action="store_true",
        help="Print the run's job (one JSON line, secrets included) instead of running it, for a launcher of "
        "your own: `kaizen train --policy P --print-job | torchrun ... -m trainer.learner`.",
    )
    add_common_options(train)
    train.set_defaults(func=train_command)


def override_value(text: str) -> object:
    """`--set` values are JSON when they parse (numbers, lists, objects), plain strings otherwise."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_overrides(items: list[str]) -> dict[str, object]:
    """`KEY=VALUE` pairs as `TrainConfig` overrides."""
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set: expected KEY=VALUE, got {item!r}")
        pairs.append((key, override_value(value)))
    return dict(pairs)


def train_command(args: argparse.Namespace) -> int:
    from gateway.scheduling import runner_config
    from migrations.runner import open_database
    from storage.locks import lock_owner
    from storage.policies import get_policy
    from trainer.control.policy_config import load_policy_config
    from trainer.control.scheduler import OwnerUnreachable, TrainOptions
    from trainer.control.training_job import NO_CANDIDATE

    settings = load_settings(args)
    configure_logging(settings.log_level)
    overrides = parse_overrides(args.set)
    options = TrainOptions(overrides, parse_since(args.since) if args.since else None, args.device)
    config = runner_config(settings)

    async def policy_of_args() -> tuple[PolicyInfo, float] | None:
        """The policy and the time-to-live of its job lock."""
        async with open_database(settings.database_url) as database, database.session() as session:
            policy = await get_policy(session, args.policy)
        if policy is None:
            return None
        # A bad --set is refused here, not later.
        return policy, load_policy_config(policy.config, train_overrides=overrides).train.lock_ttl_s

    found = asyncio.run(policy_of_args())
    if found is None:
        log.error("no policy named %r", args.policy)
        return 2
    policy, ttl_s = found
    owner = lock_owner()
    try:
        job = config.training_job(
            args.policy,
            config.base_model_path(policy.base_model),
            options,
            # A launcher of one's own runs the printed job: its trainer takes the policy's lock itself.
            lock_owner=None if args.print_job else owner,
            project=policy.project,
        )
    except OwnerUnreachable as exc:
        log.error("%s", exc)
        return 2
    if args.print_job:
        sys.stdout.buffer.write(job.encode())
        return 0
    if not asyncio.run(_take_lock(settings.database_url, policy, owner, ttl_s)):
        log.error("another job of policy %r is running", args.policy)
        return NO_CANDIDATE
    status: int | None = None
    try:
        with _lock_kept(settings.database_url, policy.name, owner, ttl_s):
            status = _run_child(config.train_command, config.train_environment(), job)
    finally:
        asyncio.run(_settle(settings.database_url, policy, owner, ttl_s, status))
    if status < 0:
        log.error("the training process was killed by %s", signal.Signals(-status).name)
        return 128 - status
    return status


def _run_child(command: Sequence[str], env: dict[str, str] | None, job: TrainingJob) -> int:
    """Run the training child with `job` on its stdin and return its exit status (negative: killed by a signal).

    In a session of its own, the child hears of a stop only from here, and once: a terminal's Ctrl-C and a
    supervisor's SIGTERM both reach this process as KeyboardInterrupt and are passed on as one SIGTERM, which
    the trainer (or torchrun, to every trainer) takes as a stop: the run is recorded failed. Should this process
    be SIGKILLed, the child gets its parent-death signal instead of training on where no Ctrl-C reaches it."""
    child = subprocess.Popen(
        dying_with_parent(command, PARENT_DEATH_SIGNAL),
        env=env,
        stdin=subprocess.PIPE,
        start_new_session=True,
    )
    assert child.stdin is not None
    try:
        child.stdin.write(job.encode())
        child.stdin.close()
    except BrokenPipeError:
        pass  # it died at once: its exit status tells
    try:
        return child.wait()
    except KeyboardInterrupt:
        child.send_signal(signal.SIGTERM)
        child.wait()
        raise


async def _take_lock(database_url: str, policy: PolicyInfo, owner: str, ttl_s: float) -> bool:
    """Take the policy's job lock for the child, and mark failed the runs a dead job left `running` (the child,
    under a lock it inherits, leaves that to its parent)."""
    from migrations.runner import open_database
    from storage.training import take_policy_lock

    async with open_database(database_url, migrate=False) as database, database.session() as session:
        return await take_policy_lock(session, policy, owner, "train", ttl_s)


@contextmanager
def _lock_kept(database_url: str, key: str, owner: str, ttl_s: float) -> Iterator[None]:
    """Renew the job lock from a thread of its own while the body runs: the child renews it too once it runs, but
    not while it starts (torch's import, torchrun's rendezvous)."""
    from migrations.runner import open_database
    from storage.locks import heartbeat

    done = threading.Event()

    async def keep() -> None:
        async with (
            open_database(database_url, migrate=False) as database,
            heartbeat(database, key, owner, ttl_s),
        ):
            await asyncio.to_thread(done.wait)

    keeper = threading.Thread(target=asyncio.run, args=(keep(),), name="job-lock-heartbeat", daemon=True)
    keeper.start()
    try:
        yield
    finally:
        done.set()
        keeper.join()


async def _settle(
    database_url: str, policy: PolicyInfo, owner: str, ttl_s: float, status: int | None
) -> None:
    """After the child: a run it left `running` was not recorded (it was killed, or crashed before it could), so
    it is marked failed with what the child died of; then the lock is released. Only while the lock is still
    this process's: otherwise another job may own the runs that are `running` now. A database that cannot be
    reached is logged, not raised: the command's outcome is the child's, and the policy's next job marks such a
    run failed once the lock has expired."""
    from sqlalchemy.exc import SQLAlchemyError

    from migrations.runner import open_database
    from storage.locks import release_lock, renew_lock
    from storage.training import fail_abandoned_runs
    from trainer.control.training_job import exit_error

    try:
        async with open_database(database_url, migrate=False) as database, database.session() as session:
            if not await renew_lock(session, policy.name, owner, ttl_s):
                log.warning(
                    "the job lock of policy %r was taken over; its runs are left as they are", policy.name
                )
                return
            error = exit_error(status) if status is not None else "interrupted"
            if abandoned := await fail_abandoned_runs(session, policy.id, error):
                log.error(
                    "run(s) %s of %s recorded no outcome; marked failed: %s", abandoned, policy.name, error
                )
            await session.commit()
            await release_lock(session, policy.name, owner)
    except (SQLAlchemyError, OSError) as exc:
        log.error(
            "could not record the end of the training run of %r, nor free the policy: %s", policy.name, exc
        )
