"""`kaizen db upgrade [REVISION]`: apply the schema migrations (`kaizen serve` applies the online-safe ones at
start too), and `kaizen db status`: what an upgrade would apply, changing nothing."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from typing import Any

from gateway.commands.options import add_common_options, configure_logging, load_settings

log = logging.getLogger("kaizen")


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    db = commands.add_parser("db", help="Database schema management.")
    db_commands = db.add_subparsers(dest="db_command", required=True)
    upgrade = db_commands.add_parser(
        "upgrade",
        help="Apply migrations up to a revision (default: head). Lists them first, and refuses those that are "
        "not safe while gateways serve unless --gateways-stopped is given.",
    )
    upgrade.add_argument("revision", nargs="?", default="head")
    upgrade.add_argument(
        "--gateways-stopped",
        action="store_true",
        help="Every `kaizen serve` and `kaizen worker` on this database is stopped: apply migrations that are "
        "not online-safe too.",
    )
    add_common_options(upgrade)
    upgrade.set_defaults(func=upgrade_command)
    status = db_commands.add_parser(
        "status", help="Print the database's revision and the migrations an upgrade would apply, as JSON."
    )
    status.add_argument("revision", nargs="?", default="head")
    add_common_options(status)
    status.set_defaults(func=status_command)


def upgrade_command(args: argparse.Namespace) -> int:
    from migrations.runner import NewerDatabase, upgrade_database

    settings = load_settings(args)
    configure_logging(settings.log_level)
    done = asyncio.run(
        upgrade_database(
            settings.database_url,
            args.revision,
            gateways_stopped=args.gateways_stopped,
            by="kaizen db upgrade",
        )
    )
    if not isinstance(done, NewerDatabase):
        log.info(
            "the database is at revision %s", done.pending[-1].revision if done.pending else done.current
        )
    return 0


def status_command(args: argparse.Namespace) -> int:
    from migrations.runner import NewerDatabase, database_plan

    settings = load_settings(args)
    configure_logging(settings.log_level)
    plan = asyncio.run(database_plan(settings.database_url, args.revision))
    report: dict[str, Any]
    if isinstance(plan, NewerDatabase):
        report = {
            "database": plan.current,
            "code_head": plan.head,
            "newer_than_code": [r.revision for r in plan.since] if plan.since is not None else None,
            "serves": plan.serves,
        }
    else:
        report = {
            "database": plan.current,
            "target": plan.target,
            "pending": [
                {
                    "revision": m.revision,
                    "title": m.title,
                    "online_safe": m.safety.safe_on(plan.dialect),
                    "why": m.safety.why,
                }
                for m in plan.pending
            ],
            "needs_gateways_stopped": bool(plan.offline),
        }
    sys.stdout.write(json.dumps(report, indent=2) + "\n")
    return 0
