"""`kaizen`: the command line, one module per command (`gateway.commands.*`), each with its own options plus
`--config`, `--data-dir` and `--database-url` (`gateway.commands.options`)."""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import Sequence

from gateway.commands import (
    backup,
    bootstrap,
    database,
    datasets,
    demo,
    judge,
    keys,
    models,
    policy,
    serve,
    train,
    worker,
)
from trainer.control.signals import SigtermAsCtrlC

log = logging.getLogger("kaizen")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kaizen", description="Kaizen: a gateway that makes an LLM agent learn."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for command in (
        serve,
        database,
        backup,
        models,
        policy,
        judge,
        train,
        bootstrap,
        worker,
        demo,
        keys,
        datasets,
    ):
        command.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    interrupt = SigtermAsCtrlC()
    try:
        with contextlib.ExitStack() as stack:
            # `serve` leaves SIGTERM to uvicorn: a graceful stop, then death by the signal, which service
            # managers count as a clean stop. The long-running worker and the demo install handlers of their own
            # while their loop runs, which take over from this one.
            if args.command != "serve":
                stack.enter_context(interrupt)
            return int(args.func(args))
    except KeyboardInterrupt:
        log.warning("%s stopped by %s", args.command, interrupt.signal.name)
        return interrupt.exit_status
    except (FileNotFoundError, ValueError) as exc:
        log.error("%s", exc)
        return 2
