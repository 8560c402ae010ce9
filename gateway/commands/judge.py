"""`kaizen judge --policy P [--since ...] [--limit N]`: score a policy's unscored groups, with a progress bar."""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import sys
from datetime import UTC, datetime, timedelta

from gateway.settings import Settings
from trainer.control.ruler import JudgeSettings

log = logging.getLogger("kaizen")

_RELATIVE = re.compile(r"^(\d+)([mhdw])$")
_UNITS = {"m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_since(value: str, now: datetime | None = None, flag: str = "--since") -> datetime:
    """`24h`, `7d`, `30m`, `2w` (ago), or an ISO date/time (UTC when it names no zone)."""
    match = _RELATIVE.match(value.strip())
    if match:
        delta = timedelta(**{_UNITS[match.group(2)]: int(match.group(1))})
        return (now or datetime.now(UTC)) - delta
    try:
        parsed = datetime.fromisoformat(value.strip())
    except ValueError as exc:
        raise ValueError(f"{flag}: expected e.g. 24h, 7d or 2026-01-31T00:00, got {value!r}") from exc
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def judge_settings(settings: Settings) -> JudgeSettings:
    return JudgeSettings(
        model=settings.judge_model,
        api_base=settings.judge_api_base or None,
        api_key=settings.judge_api_key or None,
        temperature=settings.judge_temperature,
        timeout_s=settings.judge_timeout_s,
        max_retries=settings.judge_max_retries,
        concurrency=settings.judge_concurrency,
    )


def add_judge_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--policy", required=True, help="Policy (or plain model name) whose episodes to score."
    )
    parser.add_argument("--since", help="Only episodes created since: 24h, 7d, or an ISO date/time.")
    parser.add_argument("--limit", type=int, help="Score at most this many groups.")


def run_judge(settings: Settings, policy: str, since: str | None, limit: int | None) -> int:
    from tqdm import tqdm  # type: ignore[import-untyped]

    from migrations.runner import open_database
    from trainer.control.judge_job import judge_policy

    judge = judge_settings(settings)
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
