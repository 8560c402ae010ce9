"""`kaizen worker`: the policies' schedules in a process of their own (the gateways then set
KAIZEN_SCHEDULER=false, or keep it: one job per policy runs at a time whoever starts it)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys

from gateway.commands.options import add_common_options, configure_logging, load_settings
from gateway.scheduling import Jobs
from gateway.settings import Settings
from migrations.runner import open_database
from storage.policies import list_policies
from trainer.control.scheduler import JobKind

log = logging.getLogger("kaizen")

#: Exit status of `--once` when a policy's job was skipped because another job of it was running.
BUSY_EXIT = 75


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    worker = commands.add_parser(
        "worker", help="Run the policies' scheduled jobs (judge, train, retention) without serving."
    )
    worker.add_argument(
        "--once",
        choices=["judge", "train", "retention"],
        help="Run this job now for every policy (or --policy) and exit; prints one JSON line per run.",
    )
    worker.add_argument("--policy", help="With --once: only this policy.")
    add_common_options(worker)
    worker.set_defaults(func=worker_command)


def worker_command(args: argparse.Namespace) -> int:
    """Run the schedules without serving (set KAIZEN_SCHEDULER=false on the gateways), or with `--once KIND` run
    one job of each policy (or of `--policy`) now and exit."""
    settings = load_settings(args)
    configure_logging(settings.log_level)
    if args.once:
        return run_once(settings, args.once, args.policy)
    return run_worker(settings)


def run_worker(settings: Settings) -> int:
    async def run() -> None:
        async with open_database(settings.database_url) as database:
            jobs = Jobs(settings, database, schedule=True)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await jobs.start()
            log.info("worker running the policies' schedules; Ctrl-C stops it")
            try:
                await stop.wait()
            finally:
                await jobs.stop()

    asyncio.run(run())
    return 0


def run_once(settings: Settings, kind: JobKind, policy: str | None) -> int:
    """One job per policy, one after the other; 75 when any was skipped because the policy was busy."""

    async def run() -> int:
        async with open_database(settings.database_url) as database:
            jobs = Jobs(settings, database, schedule=False)
            status = 0
            try:
                async with database.session() as session:
                    names = [p.name for p in await list_policies(session)]
                if policy is not None:
                    if policy not in names:
                        raise ValueError(f"unknown policy {policy!r}")
                    names = [policy]
                for name in names:
                    outcome = await jobs.runner.run(name, kind, trigger="worker")
                    line: dict[str, object] = {"policy": name, "kind": kind, "run_id": None, "status": "busy"}
                    if outcome is None:
                        status = BUSY_EXIT
                    else:
                        line.update(run_id=outcome.id, status=outcome.status, error=outcome.error)
                    sys.stdout.write(json.dumps(line) + "\n")
                    sys.stdout.flush()
            finally:
                await jobs.stop()
        return status

    return asyncio.run(run())
