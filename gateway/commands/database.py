"""`kaizen db upgrade [REVISION]`: apply the schema migrations (`kaizen serve` applies them at start too)."""

from __future__ import annotations

import argparse
import asyncio
import logging

from gateway.commands.options import add_common_options, configure_logging, load_settings

log = logging.getLogger("kaizen")


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    db = commands.add_parser("db", help="Database schema management.")
    db_commands = db.add_subparsers(dest="db_command", required=True)
    upgrade = db_commands.add_parser("upgrade", help="Apply migrations up to a revision (default: head).")
    upgrade.add_argument("revision", nargs="?", default="head")
    add_common_options(upgrade)
    upgrade.set_defaults(func=upgrade_command)


def upgrade_command(args: argparse.Namespace) -> int:
    from migrations.runner import upgrade_database

    settings = load_settings(args)
    configure_logging(settings.log_level)
    asyncio.run(upgrade_database(settings.database_url, args.revision))
    log.info("database is at revision %s", args.revision)
    return 0
