"""`kaizen keys create|list|revoke` (managed API keys) and `kaizen audit` (who changed what)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys
from datetime import datetime
from typing import Any

from gateway.commands.options import add_common_options, configure_logging, load_settings

log = logging.getLogger("kaizen")


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keys = commands.add_parser("keys", help="Managed API keys: create, list, revoke.")
    keys_commands = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_commands.add_parser("create", help="Create a key; prints its secret once.")
    create.add_argument("name", help="What the key is for (shown in lists and the audit log).")
    create.add_argument(
        "--scope",
        action="append",
        choices=["chat", "feedback", "read", "admin"],
        help="A scope the key has (repeat; default: chat, feedback, read).",
    )
    # "default" is storage.models.DEFAULT_PROJECT, not imported here: the CLI starts without SQLAlchemy.
    create.add_argument("--project", default="default", help="The project whose data the key sees.")
    create.add_argument(
        "--model", action="append", help="A model or policy the key may call (repeat; default: any)."
    )
    listing = keys_commands.add_parser("list", help="List keys (never their secrets).")
    listing.add_argument("--all", action="store_true", help="Include revoked keys.")
    revoke = keys_commands.add_parser("revoke", help="Revoke a key by its id.")
    revoke.add_argument("key_id")
    for sub in (create, listing, revoke):
        add_common_options(sub)
        sub.set_defaults(func=keys_command)

    audit = commands.add_parser(
        "audit", help="List audit entries (promotions, key changes, ...), newest first."
    )
    audit.add_argument("--action", help="Only this action, e.g. policy.promote or key.revoke.")
    audit.add_argument("--target", help="Only this target (a policy name, a key id).")
    audit.add_argument("--limit", type=int, default=100)
    add_common_options(audit)
    audit.set_defaults(func=audit_command)


def keys_command(args: argparse.Namespace) -> int:
    """Managed API keys, one JSON object a line on stdout. A created key's secret is printed once; gateways pick
    changes up within `KAIZEN_POLICY_REFRESH_S`."""
    from gateway.auth import create_key
    from gateway.errors import APIError
    from migrations.runner import open_database
    from storage.audit import record_audit
    from storage.keys import list_keys, revoke_key

    settings = load_settings(args)
    configure_logging(settings.log_level)

    def shown(key: Any) -> dict[str, Any]:
        view = {k: v for k, v in dataclasses.asdict(key).items() if k != "hash"}
        return {**view, "created_at": key.created_at.isoformat(), "revoked_at": _iso(key.revoked_at)}

    async def run() -> list[dict[str, Any]] | None:
        async with open_database(settings.database_url) as database, database.session() as session:
            if args.keys_command == "create":
                scopes = args.scope or ["chat", "feedback", "read"]
                key, secret = await create_key(session, args.name, scopes, args.project, args.model)
                details = {
                    "name": key.name,
                    "scopes": key.scopes,
                    "project": key.project,
                    "models": key.models,
                }
                await record_audit(session, "cli", "key.create", key.id, details)
                await session.commit()
                return [{**shown(key), "secret": secret}]
            if args.keys_command == "revoke":
                revoked = await revoke_key(session, args.key_id)
                if revoked is None:
                    return None
                await record_audit(session, "cli", "key.revoke", revoked.id, {"name": revoked.name})
                await session.commit()
                return [shown(revoked)]
            return [shown(k) for k in await list_keys(session, include_revoked=args.all)]

    try:
        rows = asyncio.run(run())
    except APIError as exc:
        log.error("%s", exc.message)
        return 2
    if rows is None:
        log.error("no key %r", args.key_id)
        return 2
    sys.stdout.write("".join(json.dumps(row) + "\n" for row in rows))
    return 0


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def audit_command(args: argparse.Namespace) -> int:
    """The newest audit entries, one JSON object a line."""
    from migrations.runner import open_database
    from storage.audit import list_audit

    settings = load_settings(args)

    async def run() -> list[dict[str, Any]]:
        async with (
            open_database(settings.database_url, migrate=False) as database,
            database.session() as session,
        ):
            entries = await list_audit(session, action=args.action, target=args.target, limit=args.limit)
        return [{**dataclasses.asdict(e), "at": e.at.isoformat()} for e in entries]

    sys.stdout.write("".join(json.dumps(row) + "\n" for row in asyncio.run(run())))
    return 0
