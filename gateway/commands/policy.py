"""`kaizen policy create|list|owner|promote|rollback|compare`: policies, the trainable models, their owners and
versions (`rollout` and `pin`: `gateway.commands.rollouts`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.commands import rollouts
from gateway.commands.options import add_common_options, configure_logging, load_settings, parse_since

if TYPE_CHECKING:
    from storage.version_rewards import Difference, RewardStats

log = logging.getLogger("kaizen")


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    policy = commands.add_parser("policy", help="Policies: trainable models with LoRA versions.")
    policy_commands = policy.add_subparsers(dest="policy_command", required=True)
    create = policy_commands.add_parser(
        "create", help="Create a policy with version 0 (a zero-effect LoRA) active."
    )
    create.add_argument("name")
    create.add_argument("--exist-ok", action="store_true", help="Succeed if the policy already exists.")
    create.add_argument(
        "--policy-config",
        type=Path,
        metavar="FILE",
        help="JSON file with the policy's configuration (sections rewards, train, schedule, gate).",
    )
    add_owner_options(create, "the built-in project `default`, that of the environment's keys")
    add_common_options(create, "base_model")
    create.set_defaults(func=create_command)
    owner = policy_commands.add_parser(
        "owner", help="Give a policy to one project (--project) or share it with every project (--shared)."
    )
    owner.add_argument("name")
    add_owner_options(owner, None)
    add_common_options(owner)
    owner.set_defaults(func=owner_command)
    promote = policy_commands.add_parser("promote", help="Make version N the active version of a policy.")
    promote.add_argument("name")
    promote.add_argument("version", type=int)
    add_common_options(promote)
    promote.set_defaults(func=switch_command)
    rollback = policy_commands.add_parser("rollback", help="Re-activate the previously active version.")
    rollback.add_argument("name")
    add_common_options(rollback)
    rollback.set_defaults(func=switch_command)
    listing = policy_commands.add_parser("list", help="List policies and their versions.")
    add_common_options(listing)
    listing.set_defaults(func=list_command)
    compare = policy_commands.add_parser(
        "compare", help="Live reward of two versions with 95%% intervals, and whether they differ."
    )
    compare.add_argument("name")
    compare.add_argument("a", type=int, help="The version to compare against (e.g. the active one).")
    compare.add_argument("b", type=int, help="The version compared (e.g. a candidate).")
    compare.add_argument(
        "--since",
        metavar="TIME",
        help="Only episodes started at or after this time: 24h, 7d (ago) or an ISO 8601 time (UTC without an "
        "offset); default: all time.",
    )
    add_common_options(compare)
    compare.set_defaults(func=compare_command)
    rollouts.register(policy_commands)


def add_owner_options(parser: argparse.ArgumentParser, default: str | None) -> None:
    """--project P | --shared; `default` says who owns the policy when neither is given (None: one is required)."""
    group = parser.add_mutually_exclusive_group(required=default is None)
    owned = "Only this project's keys call the policy and only its episodes train it"
    group.add_argument("--project", help=owned + (f" (default: {default})." if default is not None else "."))
    group.add_argument(
        "--shared",
        action="store_true",
        help="Every project's keys call the policy and it trains on every project's episodes.",
    )


def owner_command(args: argparse.Namespace) -> int:
    """`kaizen policy owner P --project X | --shared`."""
    from gateway.policies import InvalidOwner, change_policy_owner
    from migrations.runner import open_database

    settings = load_settings(args)
    configure_logging(settings.log_level)

    async def run() -> str | None:
        async with (
            open_database(settings.database_url, migrate=False) as database,
            database.session() as session,
        ):
            owner = await change_policy_owner(session, args.name, args.project, args.shared, "cli")
            await session.commit()
        return owner

    try:
        owner = asyncio.run(run())
    except (LookupError, InvalidOwner) as exc:
        log.error("%s", exc)
        return 2
    log.info(
        "policy %s: %s",
        args.name,
        "shared by every project" if owner is None else f"owned by project {owner!r}",
    )
    return 0


def create_command(args: argparse.Namespace) -> int:
    from gateway.policies import (
        InvalidOwner,
        check_policy_urls,
        create_policy_with_initial_adapter,
        policy_owner,
    )
    from migrations.runner import open_database
    from storage.models import DEFAULT_PROJECT

    settings = load_settings(args)
    configure_logging(settings.log_level)
    config = json.loads(args.policy_config.read_text()) if args.policy_config else None
    try:
        owner = policy_owner(args.project, args.shared, DEFAULT_PROJECT)
    except InvalidOwner as exc:
        log.error("%s", exc)
        return 2

    async def run() -> None:
        async with open_database(settings.database_url) as database:
            await check_policy_urls(  # its warnings are logged
                config,
                private_networks=settings.outbound_private_networks,
                signed=bool(settings.feedback_secret),
            )
            policy = await create_policy_with_initial_adapter(
                database,
                settings.data_dir,
                args.name,
                settings.base_model,
                config,
                actor="cli",
                project=owner,
                exist_ok=args.exist_ok,
            )
        log.info(
            "policy %s: base %s, active version %s", policy.name, policy.base_model, policy.active_version
        )

    asyncio.run(run())
    return 0


def list_command(args: argparse.Namespace) -> int:
    from migrations.runner import open_database
    from storage.policies import list_adapters, list_policies

    settings = load_settings(args)

    async def run() -> list[str]:
        async with (
            open_database(settings.database_url, migrate=False) as database,
            database.session() as session,
        ):
            lines = []
            for policy in await list_policies(session):
                versions = ", ".join(
                    f"{a.version}:{a.status}" for a in await list_adapters(session, policy.id)
                )
                owner = "shared" if policy.project is None else f"project={policy.project}"
                lines.append(
                    f"{policy.name}\tbase={policy.base_model}\tactive={policy.active_version}\t{owner}\t"
                    f"{versions}"
                )
            return lines

    sys.stdout.write("".join(line + "\n" for line in asyncio.run(run())))
    return 0


def switch_command(args: argparse.Namespace) -> int:
    """`kaizen policy promote P N` and `kaizen policy rollback P`."""
    from gateway.rollouts import settle_after_switch
    from migrations.runner import open_database
    from storage.audit import record_audit
    from storage.policies import get_policy, promote, rollback

    settings = load_settings(args)
    configure_logging(settings.log_level)

    async def run() -> int | None:
        async with (
            open_database(settings.database_url, migrate=False) as database,
            database.session() as session,
        ):
            # The entry goes first: the switch commits it with the change, and a refusal leaves neither.
            if args.policy_command == "promote":
                await record_audit(session, "cli", "policy.promote", args.name, {"version": args.version})
                policy = await promote(session, args.name, args.version)
            else:
                current = await get_policy(session, args.name)
                from_version = current.active_version if current else None
                await record_audit(
                    session, "cli", "policy.rollback", args.name, {"from_version": from_version}
                )
                policy = await rollback(session, args.name)
            await settle_after_switch(session, args.name, policy.active_version, "cli")
            await session.commit()
            return policy.active_version

    try:
        version = asyncio.run(run())
    except LookupError as exc:
        log.error("%s", exc)
        return 2
    log.info("policy %s: version %s is active", args.name, version)
    return 0


def compare_command(args: argparse.Namespace) -> int:
    """`kaizen policy compare P A B`: a table of both versions' live reward and of B - A."""
    from migrations.runner import open_database
    from storage.version_rewards import compare_version_rewards

    settings = load_settings(args)
    configure_logging(settings.log_level)
    try:
        since = parse_since(args.since) if args.since else None
    except ValueError as exc:
        log.error("%s", exc)
        return 2

    async def run() -> str:
        async with (
            open_database(settings.database_url, migrate=False) as database,
            database.session() as session,
        ):
            compared = await compare_version_rewards(session, args.name, args.a, args.b, since)
        if compared is None:
            raise LookupError(f"no policy named {args.name!r}")
        a, b, found = compared
        return compare_table(args.a, a.stats, args.b, b.stats, found)

    try:
        table = asyncio.run(run())
    except LookupError as exc:
        log.error("%s", exc)
        return 2
    sys.stdout.write(table)
    return 0


def _value(value: float | None, sign: str = "") -> str:
    return "-" if value is None else f"{value:{sign}.4f}"


def _interval(low: float | None, high: float | None, sign: str = "") -> str:
    return "-" if low is None or high is None else f"[{low:{sign}.4f}, {high:{sign}.4f}]"


def compare_table(a: int, stats_a: RewardStats, b: int, stats_b: RewardStats, diff: Difference) -> str:
    """Rewarded episodes, mean reward and its 95% interval of each version, then the difference b - a."""
    rows = [("version", "episodes", "mean", "95% interval", "")]
    for version, s in ((a, stats_a), (b, stats_b)):
        rows.append((str(version), str(s.episodes), _value(s.mean), _interval(s.low, s.high), ""))
    verdict = (
        "undefined"
        if diff.low is None
        else f"{'better' if diff.low > 0 else 'worse'} (excludes 0)"
        if diff.significant
        else "no clear difference"
    )
    rows.append((f"{b} - {a}", "", _value(diff.diff, "+"), _interval(diff.low, diff.high, "+"), verdict))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    return "".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() + "\n" for row in rows
    )
