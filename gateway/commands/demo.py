"""`kaizen demo`: the whole learning loop on this machine (the work is `gateway.demo`'s)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from gateway.commands.options import (
    add_common_options,
    configure_logging,
    load_settings,
    quiet_per_request_loggers,
)
from gateway.demo.agent_tasks import AGENT_TASKS
from gateway.demo.tasks import TASKS


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = commands.add_parser(
        "demo",
        help="Run the whole learning loop on this machine: a simulated app's traffic, feedback, scheduled "
        "training, the gate and hot reload; prints each cycle's serving version and mean reward.",
    )
    demo.add_argument(
        "--out", type=Path, help="Write demo.json, demo.png and the gateway log here (and keep its data)."
    )
    demo.add_argument("--minutes", type=float, default=20.0, help="How long the traffic runs at most.")
    demo.add_argument(
        "--stop-at-target",
        action="store_true",
        help="End as soon as a cycle answered by a trained version reaches the task's target reward.",
    )
    demo.add_argument(
        "--cycle-calls", type=int, default=60, help="Calls per reported cycle (60: every question once)."
    )
    demo.add_argument("--rate", type=float, default=0.5, help="Calls per second the simulated app sends.")
    demo.add_argument("--concurrency", type=int, default=8, help="Most calls the app has in flight at once.")
    demo.add_argument("--seed", type=int, default=0, help="Seeds the question order and training.")
    demo.add_argument(
        "--task",
        choices=sorted([*TASKS, *AGENT_TASKS]),
        default="opposites",
        help="What the simulated app asks (gateway/demo/tasks.py): `opposites`, which the base model gets "
        "right now and then, or `past-tense`, where its successes are rare; or an agent task "
        "(gateway/demo/agent_tasks.py): `lockers`, where the app offers a tool and rewards each episode once.",
    )
    add_common_options(demo, "base_model")
    demo.set_defaults(func=demo_command)


def demo_command(args: argparse.Namespace) -> int:
    from gateway.demo.runner import DemoOptions, demo_main

    settings = load_settings(args)
    configure_logging(settings.log_level)
    quiet_per_request_loggers("httpx", "httpx2", "openai")
    out: Path | None = args.out
    data_dir = out / "data" if out is not None else Path(tempfile.mkdtemp(prefix="kaizen-demo-"))
    options = DemoOptions(
        out=out,
        data_dir=data_dir,
        models_dir=settings.data_dir / "models",
        base_model=settings.base_model,
        minutes=args.minutes,
        cycle_calls=args.cycle_calls,
        rate=args.rate,
        concurrency=args.concurrency,
        seed=args.seed,
        task=args.task,
        stop_at_target=args.stop_at_target,
    )
    return demo_main(options)
