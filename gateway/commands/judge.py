"""`kaizen judge --policy P [--since ...] [--limit N]`: score a policy's unscored groups, with a progress bar."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from gateway.commands.options import add_common_options, configure_logging, load_settings, parse_since

log = logging.getLogger("kaizen")


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "judge", help="Score unscored groups of a policy's episodes (RULER or the policy's scorer)."
    )
    parser.add_argument(
        "--policy", required=True, help="Policy (or plain model name) whose episodes to score."
    )
    parser.add_argument("--since", help="Only episodes created since: 24h, 7d, or an ISO date/time.")
    parser.add_argument("--limit", type=int, help="Score at most this many groups.")
    add_common_options(parser)
    parser.set_defaults(func=judge_command)


def judge_command(args: argparse.Namespace) -> int:
    """Exit 1 when every group failed to score."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    from migrations.runner import open_database
    from trainer.control.judge_job import judge_policy

    settings = load_settings(args)
    configure_logging(settings.log_level)
    policy, since, limit = args.policy, args.since, args.limit
    judge = settings.judge()
    start = parse_since(since) if since else None

    async def run() -> int:
        bar = tqdm(total=0, unit="group", desc=f"judging {policy}", file=sys.stderr, disable=None)

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.n = done
            bar.refresh()

        try:
            async with open_database(settings.database_url) as database:
                report = await judge_policy(
                    database,
                    policy,
                    judge,
                    webhook_secret=settings.feedback_secret,
                    since=start,
                    limit=limit,
                    progress=progress,
                )
        finally:
            bar.close()
        log.info(
            "%s: %d groups scored, %d failed, %d too small to judge yet, %d rewards written",
            policy,
            report.judged,
            report.failed,
            report.too_small,
            report.rewards,
        )
        return 1 if report.failed and not report.judged else 0

    return asyncio.run(run())
