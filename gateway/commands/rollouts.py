"""`kaizen policy rollout start|list|end` and `kaizen policy pin|unpin|pins`: versions on trial beside the
active one, and versions pinned for a project or a key."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from gateway.commands.options import add_common_options, configure_logging, load_settings

log = logging.getLogger("kaizen")
T = TypeVar("T")


def register(policy_commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    rollout = policy_commands.add_parser(
        "rollout", help="Canaries, splits and shadows: a version on trial beside the active one."
    )
    rollout_commands = rollout.add_subparsers(dest="rollout_command", required=True)
    start = rollout_commands.add_parser("start", help="Put version N on trial.")
    start.add_argument("name")
    start.add_argument("version", type=int)
    start.add_argument("--share", type=float, required=True, help="Share of calls, above 0 and at most 1.")
    start.add_argument(
        "--mode",
        choices=("canary", "split", "shadow"),
        default="canary",
        help="canary: promoted or rolled back on live evidence (default); split: served until ended by hand; "
        "shadow: answers copies of calls that nobody sees.",
    )
    start.add_argument(
        "--rule",
        metavar="JSON",
        default="{}",
        help="Keys of the policy's rollout section that differ for this one, e.g. '{\"alpha\": 0.01}'.",
    )
    add_common_options(start)
    start.set_defaults(func=start_command)
    listing = rollout_commands.add_parser("list", help="The policy's rollouts, newest first.")
    listing.add_argument("name")
    add_common_options(listing)
    listing.set_defaults(func=list_command)
    end = rollout_commands.add_parser("end", help="End a running rollout by hand.")
    end.add_argument("name")
    end.add_argument("rollout_id", type=int)
    end.add_argument("--as", dest="status", choices=("promoted", "rolled_back", "stopped"), required=True)
    end.add_argument("--reason", default="by hand")
    add_common_options(end)
    end.set_defaults(func=end_command)

    pin = policy_commands.add_parser("pin", help="Serve a project's or a key's calls from version N.")
    pin.add_argument("name")
    pin.add_argument("version", type=int)
    _subject_options(pin)
    add_common_options(pin)
    pin.set_defaults(func=pin_command)
    unpin = policy_commands.add_parser("unpin", help="Drop a project's or a key's pin.")
    unpin.add_argument("name")
    _subject_options(unpin)
    add_common_options(unpin)
    unpin.set_defaults(func=unpin_command)
    pins = policy_commands.add_parser("pins", help="The policy's pins.")
    pins.add_argument("name")
    add_common_options(pins)
    pins.set_defaults(func=pins_command)


def _subject_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--project", help="The project whose keys' calls are pinned.")
    group.add_argument("--key", help="The id of the key whose calls are pinned.")


def _run(args: argparse.Namespace, job: Callable[[Any], Awaitable[T]]) -> T:
    """`job(session)` on the configured database."""
    from migrations.runner import open_database

    settings = load_settings(args)
    configure_logging(settings.log_level)

    async def run() -> T:
        async with (
            open_database(settings.database_url, migrate=False) as database,
            database.session() as session,
        ):
            return await job(session)

    return asyncio.run(run())


def start_command(args: argparse.Namespace) -> int:
    from gateway.rollouts import begin_rollout
    from storage.rollouts import RolloutRefused
    from trainer.control.policy_config import InvalidPolicyConfig

    try:
        overrides = json.loads(args.rule)
        if not isinstance(overrides, dict):
            raise ValueError("--rule must be a JSON object")
        rollout = _run(
            args,
            lambda session: begin_rollout(
                session,
                args.name,
                args.version,
                mode=args.mode,
                share=args.share,
                actor="cli",
                overrides=overrides,
            ),
        )
    except (ValueError, LookupError, RolloutRefused, InvalidPolicyConfig) as exc:
        log.error("%s", exc)
        return 2
    log.info(
        "rollout %d: %s of %s@%d on %g%% of calls beside version %s",
        rollout.id,
        rollout.mode,
        rollout.policy,
        rollout.version,
        rollout.share * 100,
        rollout.baseline_version,
    )
    return 0


def list_command(args: argparse.Namespace) -> int:
    from storage.rollouts import list_rollouts

    rollouts = _run(args, lambda session: list_rollouts(session, args.name))
    rows = [("id", "mode", "version", "vs", "share", "status", "difference", "reason")]
    for r in rollouts:
        found = r.stats.get("difference") or {}
        low, high = found.get("low"), found.get("high")
        interval = "-" if low is None or high is None else f"[{low:+.3f}, {high:+.3f}]"
        rows.append(
            (
                str(r.id),
                r.mode,
                str(r.version),
                str(r.baseline_version),
                f"{r.share:g}",
                r.status,
                interval,
                r.reason or r.stats.get("reason") or "",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    sys.stdout.write(
        "".join(
            "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() + "\n" for row in rows
        )
    )
    return 0


def end_command(args: argparse.Namespace) -> int:
    from storage.rollouts import RolloutRefused, end_rollout, get_rollout

    async def end(session: Any) -> str:
        found = await get_rollout(session, args.rollout_id)
        if found is None or found.policy != args.name:
            raise LookupError(f"policy {args.name!r} has no rollout {args.rollout_id}")
        ended = await end_rollout(session, args.rollout_id, args.status, reason=args.reason, actor="cli")
        await session.commit()
        return ended.status

    try:
        status = _run(args, end)
    except (LookupError, RolloutRefused) as exc:
        log.error("%s", exc)
        return 2
    log.info("rollout %d of %s: %s", args.rollout_id, args.name, status)
    return 0


def _subject(args: argparse.Namespace) -> tuple[str, str]:
    return ("project", args.project) if args.project is not None else ("key", args.key)


def pin_command(args: argparse.Namespace) -> int:
    from storage.rollouts import RolloutRefused, set_pin

    scope, subject = _subject(args)

    async def pin(session: Any) -> None:
        await set_pin(session, args.name, scope, subject, args.version, actor="cli")  # type: ignore[arg-type]
        await session.commit()

    try:
        _run(args, pin)
    except (LookupError, RolloutRefused) as exc:
        log.error("%s", exc)
        return 2
    log.info("policy %s: %s %s is served by version %d", args.name, scope, subject, args.version)
    return 0


def unpin_command(args: argparse.Namespace) -> int:
    from storage.rollouts import remove_pin

    scope, subject = _subject(args)

    async def unpin(session: Any) -> bool:
        removed = await remove_pin(session, args.name, scope, subject, actor="cli")
        await session.commit()
        return removed

    try:
        removed = _run(args, unpin)
    except LookupError as exc:
        log.error("%s", exc)
        return 2
    if not removed:
        log.error("policy %s has no pin for %s %s", args.name, scope, subject)
        return 2
    log.info("policy %s: %s %s follows the active version again", args.name, scope, subject)
    return 0


def pins_command(args: argparse.Namespace) -> int:
    from storage.rollouts import list_pins

    pins = _run(args, lambda session: list_pins(session, args.name))
    sys.stdout.write("".join(f"{p.scope}\t{p.subject}\t{p.version}\n" for p in pins))
    return 0
