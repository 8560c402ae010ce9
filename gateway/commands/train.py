"""`kaizen train --policy P`: one GRPO run of a policy now, in the foreground.

It starts exactly the training child the scheduler starts (`python -m trainer.learner`, through torchrun when
`KAIZEN_TRAIN_PROCESSES` > 1) with the same `TrainingJob` on its stdin, shows its log, and exits with its status:
0 when a candidate version was written, 3 when the run was skipped or failed. The candidate is not gated or
promoted (`kaizen policy promote`, or let the schedule's run do it). `--print-job` prints the job instead, for
launchers of one's own (several machines through torchrun: docker/train-*.yaml).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import subprocess
import sys

from gateway.commands.options import add_common_options, configure_logging, load_settings, parse_since
from trainer.control.child_processes import PARENT_DEATH_SIGNAL, dying_with_parent

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
    from storage.policies import PolicyInfo, get_policy
    from trainer.control.policy_config import load_policy_config
    from trainer.control.scheduler import OwnerUnreachable, TrainOptions

    settings = load_settings(args)
    configure_logging(settings.log_level)
    overrides = parse_overrides(args.set)
    options = TrainOptions(overrides, parse_since(args.since) if args.since else None, args.device)
    config = runner_config(settings)

    async def policy_of_args() -> PolicyInfo | None:
        async with open_database(settings.database_url) as database, database.session() as session:
            policy = await get_policy(session, args.policy)
        if policy is None:
            return None
        load_policy_config(policy.config, train_overrides=overrides)  # a bad --set is refused here, not later
        return policy

    policy = asyncio.run(policy_of_args())
    if policy is None:
        log.error("no policy named %r", args.policy)
        return 2
    try:
        job = config.training_job(
            args.policy, config.base_model_path(policy.base_model), options, project=policy.project
        )
    except OwnerUnreachable as exc:
        log.error("%s", exc)
        return 2
    if args.print_job:
        sys.stdout.buffer.write(job.encode())
        return 0
    # In a session of its own, the child hears of a stop only from here, and once: a terminal's Ctrl-C and a
    # supervisor's SIGTERM both reach this process as KeyboardInterrupt and are passed on as one SIGTERM, which
    # the trainer (or torchrun, to every trainer) takes as a stop: the run is recorded failed. Should this process
    # be SIGKILLed, the child gets its parent-death signal instead of training on where no Ctrl-C reaches it.
    child = subprocess.Popen(
        dying_with_parent(config.train_command, PARENT_DEATH_SIGNAL),
        env=config.train_environment(),
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
        status = child.wait()
    except KeyboardInterrupt:
        child.send_signal(signal.SIGTERM)
        child.wait()
        raise
    if status < 0:  # killed before it could record its run, which stays `running` and holds the policy's lock
        log.error(
            "the training process was killed by %s; the policy's next job marks its run failed once the "
            "run's lock has expired",
            signal.Signals(-status).name,
        )
        return 128 - status
    return status
