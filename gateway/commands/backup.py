"""`kaizen backup DEST` and `kaizen restore SRC`: a consistent backup of the database, the adapter files its versions
name and the capture log's calls not stored yet, taken while the gateway serves, and its restore
(`gateway.backup`; docs/operations.md#backup-and-restore)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from pathlib import Path

from gateway.commands.options import add_common_options, configure_logging, load_settings


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    backup = commands.add_parser(
        "backup",
        help="Back up the database, the adapter files of its versions and the capture log into a new directory, "
        "while the gateway serves.",
    )
    backup.add_argument("destination", type=Path, help="A directory that does not exist yet (or is empty).")
    add_common_options(backup, "pg_bin_dir")
    backup.set_defaults(func=backup_command)
    restore = commands.add_parser(
        "restore",
        help="Restore a backup into the data directory and database the settings name (an older schema is "
        "upgraded); the gateway started there next serves the same versions and stores the backed-up capture log.",
    )
    restore.add_argument("source", type=Path, help="A directory `kaizen backup` wrote.")
    restore.add_argument(
        "--force",
        action="store_true",
        help="Replace what the target holds: the database's tables and views, the adapter store, capture logs and "
        "keys of the data directory (refused without it).",
    )
    add_common_options(restore, "pg_bin_dir")
    restore.set_defaults(func=restore_command)


def backup_command(args: argparse.Namespace) -> int:
    from gateway.backup.take import take_backup

    settings = load_settings(args)
    configure_logging(settings.log_level)
    manifest = asyncio.run(take_backup(settings, args.destination))
    summary = {
        "backup": str(args.destination),
        "database": manifest.database,
        "schema_revision": manifest.schema_revision,
        "active_versions": manifest.active_versions,
        "adapter_versions": sum(entry.in_backup for entry in manifest.adapters),
        "capture_calls": manifest.capture_calls,
        "bytes": sum(entry.bytes for entry in manifest.files),
    }
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0


def restore_command(args: argparse.Namespace) -> int:
    from gateway.backup.restore import restore_backup

    settings = load_settings(args)
    configure_logging(settings.log_level)
    report = asyncio.run(restore_backup(settings, args.source, force=args.force))
    sys.stdout.write(json.dumps(dataclasses.asdict(report)) + "\n")
    return 0
