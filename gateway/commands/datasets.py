"""The command-line side of datasets: `kaizen export` (episodes to Parquet or JSON lines, with a progress bar)
and `kaizen import` (conversations in OpenAI's chat format to episodes).

The work is `storage.export`'s and `gateway.commands.conversation_import`'s, imported only when a command runs: export
needs polars and pyarrow, which a process that only parses the command line must not load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path

from gateway.commands.options import add_common_options, configure_logging, load_settings, parse_since

log = logging.getLogger("kaizen")


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    export = commands.add_parser(
        "export",
        help="Write episodes (messages, tools, rewards, provenance) to Parquet or JSON lines, in Kaizen's schema "
        "or OpenAI's fine-tuning chat format; streamed, with a progress bar.",
    )
    _add_export_arguments(export)
    add_common_options(export)
    export.set_defaults(func=export_command)
    importing = commands.add_parser(
        "import",
        help="Store conversations (OpenAI chat JSON lines, optionally rewarded) as episodes of a policy "
        "(source `import`); validated first, idempotent.",
    )
    _add_import_arguments(importing)
    add_common_options(importing)
    importing.set_defaults(func=import_command)


def _add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", type=Path, help="The file to write (.parquet or .jsonl).")
    parser.add_argument(
        "--format",
        choices=["parquet", "jsonl"],
        help="Default: from the file's suffix (.jsonl, else Parquet).",
    )
    parser.add_argument(
        "--schema",
        choices=["kaizen", "openai"],
        default="kaizen",
        help="kaizen: every field of an episode (rewards, turns, provenance); openai: OpenAI's fine-tuning "
        'chat format, {"messages", "tools"} per row.',
    )
    parser.add_argument("--policy", help="Only this policy's episodes.")
    parser.add_argument("--project", help="Only this project's episodes.")
    parser.add_argument(
        "--version",
        type=int,
        action="append",
        help="Only episodes with a turn served by this version (repeat).",
    )
    parser.add_argument("--since", help="Only episodes created since: 24h, 7d, or an ISO date/time.")
    parser.add_argument("--until", help="Only episodes created before: 24h (ago), or an ISO date/time.")
    parser.add_argument("--min-reward", type=float, help="Only episodes with a reward of at least this.")
    parser.add_argument("--max-reward", type=float, help="Only episodes with a reward of at most this.")
    parser.add_argument(
        "--source", action="append", help="Only episodes of this source: traffic, import, ... (repeat)."
    )
    parser.add_argument("--batch-size", type=int, default=500, help="Episodes read and written at a time.")


def export_command(args: argparse.Namespace) -> int:
    from tqdm import tqdm  # type: ignore[import-untyped]

    from migrations.runner import open_database
    from storage.export import ExportFilter, Format, count_episodes, export_episodes

    settings = load_settings(args)
    configure_logging(settings.log_level)
    if args.batch_size < 1:
        raise ValueError("--batch-size must be at least 1")
    fmt: Format = args.format or ("jsonl" if args.out.suffix.lower() in (".jsonl", ".ndjson") else "parquet")
    selection = ExportFilter(
        policy=args.policy,
        project=args.project,
        versions=tuple(args.version or ()),
        since=parse_since(args.since) if args.since else None,
        until=parse_since(args.until, flag="--until") if args.until else None,
        min_reward=args.min_reward,
        max_reward=args.max_reward,
        sources=tuple(args.source or ()),
    )

    async def run() -> dict[str, object]:
        async with open_database(settings.database_url, migrate=False) as database:
            async with database.session() as session:
                total = await count_episodes(session, selection)
            bar = tqdm(
                total=total, unit="episode", desc=f"exporting to {args.out}", file=sys.stderr, disable=None
            )
            try:
                report = await export_episodes(
                    database,
                    args.out,
                    fmt=fmt,
                    schema=args.schema,
                    selection=selection,
                    batch_size=args.batch_size,
                    progress=bar.update,
                )
            finally:
                bar.close()
        return vars(report)

    summary = asyncio.run(run())
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0


def _add_import_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "file", type=Path, help="JSON lines in OpenAI's chat format, one conversation a line."
    )
    parser.add_argument("--policy", required=True, help="The policy the conversations become episodes of.")
    parser.add_argument(
        "--project",
        help="The project the episodes belong to (default: the policy's owner; for a shared one `default`).",
    )
    parser.add_argument(
        "--reward-name", default="import", help="Name of the rewards the lines' `reward` values become."
    )
    parser.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="Import the valid lines and report the others (default: a bad line stops the import, nothing stored).",
    )
    parser.add_argument("--batch-size", type=int, default=500, help="Conversations stored per transaction.")


def import_command(args: argparse.Namespace) -> int:
    from gateway.commands.conversation_import import ImportFailed, import_conversations
    from migrations.runner import open_database

    settings = load_settings(args)
    configure_logging(settings.log_level)
    if args.batch_size < 1:
        raise ValueError("--batch-size must be at least 1")
    if not args.file.is_file():
        raise FileNotFoundError(f"no such file: {args.file}")

    async def run() -> dict[str, object]:
        async with open_database(settings.database_url) as database:
            report = await import_conversations(
                settings,
                database,
                args.file,
                args.policy,
                project=args.project,
                reward_name=args.reward_name,
                skip_bad_lines=args.skip_bad_lines,
                batch_size=args.batch_size,
            )
        return vars(report)

    try:
        summary = asyncio.run(run())
    except ImportFailed as exc:
        log.error("%s", exc)
        return 2
    for error in summary["errors"]:  # type: ignore[attr-defined]
        log.warning("skipped %s", error)
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0
