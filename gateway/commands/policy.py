"""`kaizen policy create|list|owner|promote|rollback`: policies, the trainable models, their owners and versions."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path

from gateway.commands.options import add_common_options, configure_logging, load_settings

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
    from gateway.policies import InvalidOwner, policy_owner
    from migrations.runner import open_database
    from storage.audit import record_audit
    from storage.policies import get_policy, set_policy_owner

    settings = load_settings(args)
    configure_logging(settings.log_level)

    async def run() -> str | None:
        owner = policy_owner(args.project, args.shared, "")
        async with (
            open_database(settings.database_url, migrate=False) as database,
            database.session() as session,
        ):
            policy = await get_policy(session, args.name)
            if policy is None:
                raise LookupError(f"no policy named {args.name!r}")
            await set_policy_owner(session, policy.id, owner)
            details = {"from_project": policy.project, "project": owner, "shared": owner is None}
            await record_audit(session, "cli", "policy.owner", args.name, details)
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
            return policy.active_version

    try:
        version = asyncio.run(run())
    except LookupError as exc:
        log.error("%s", exc)
        return 2
    log.info("policy %s: version %s is active", args.name, version)
    return 0
