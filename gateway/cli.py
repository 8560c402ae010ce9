"""The `kaizen` command line. Every settings field is also a flag of `kaizen serve` (documented by --help)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo

from gateway.settings import Settings

log = logging.getLogger("kaizen")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_bool(info: FieldInfo) -> bool:
    return info.annotation is bool


def _choices(info: FieldInfo) -> list[Any] | None:
    if typing.get_origin(info.annotation) is typing.Literal:
        return list(typing.get_args(info.annotation))
    return None


def _scalar_type(info: FieldInfo) -> Callable[[str], Any]:
    annotation = info.annotation
    if isinstance(annotation, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    converters: dict[Any, Callable[[str], Any]] = {int: int, float: float, Path: Path}
    return converters.get(annotation, str)


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per settings field, with the field's description, environment variable and default."""
    parser.add_argument("--config", type=Path, help="TOML file with settings (keys are the field names).")
    for name, info in Settings.model_fields.items():
        default = info.get_default(call_default_factory=True)
        shown = ",".join(default) if isinstance(default, list) else default
        text = f"{info.description} [env KAIZEN_{name.upper()}; default: {shown!s}]".replace("%", "%%")
        if _is_bool(info):
            parser.add_argument(
                _flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None, help=text
            )
        else:
            parser.add_argument(
                _flag(name),
                dest=name,
                default=None,
                choices=_choices(info),
                type=_scalar_type(info),
                help=text,
            )


def load_settings(args: argparse.Namespace) -> Settings:
    overrides = {name: getattr(args, name, None) for name in Settings.model_fields}
    return Settings.load(args.config, **overrides)


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import build_services, create_app
    from storage.schema import upgrade_database

    settings = load_settings(args)
    configure_logging(settings.log_level)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    log.info("applying database migrations (%s)", settings.database_url.split("@")[-1])
    asyncio.run(upgrade_database(settings.database_url))
    app = create_app(build_services(settings))
    log.info("serving on http://%s:%d/v1 (engine: %s)", settings.host, settings.port, settings.engine)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        log_level=settings.log_level,
        access_log=False,
        timeout_graceful_shutdown=30,
    )
    return 0


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from storage.schema import upgrade_database

    settings = load_settings(args)
    configure_logging(settings.log_level)
    asyncio.run(upgrade_database(settings.database_url, args.revision))
    log.info("database is at revision %s", args.revision)
    return 0


def settings_table() -> str:
    """Every setting as a Markdown table (the README's settings section is this output)."""
    lines = ["| environment variable | default | meaning |", "|---|---|---|"]
    for name, info in Settings.model_fields.items():
        default = info.get_default(call_default_factory=True)
        shown = ",".join(default) if isinstance(default, list) else str(default)
        lines.append(f"| `KAIZEN_{name.upper()}` | `{shown}` | {info.description} |")
    return "\n".join(lines)


def cmd_settings(_: argparse.Namespace) -> int:
    sys.stdout.write(settings_table() + "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kaizen", description="Kaizen: a gateway that makes an LLM agent learn."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="Run the gateway (applies migrations first).")
    add_settings_flags(serve)
    serve.set_defaults(func=cmd_serve)

    db = commands.add_parser("db", help="Database schema management.")
    db_commands = db.add_subparsers(dest="db_command", required=True)
    upgrade = db_commands.add_parser("upgrade", help="Apply migrations up to a revision (default: head).")
    upgrade.add_argument("revision", nargs="?", default="head")
    add_settings_flags(upgrade)
    upgrade.set_defaults(func=cmd_db_upgrade)

    settings = commands.add_parser(
        "settings", help="Print every setting with its default, as a Markdown table."
    )
    settings.set_defaults(func=cmd_settings)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (FileNotFoundError, ValueError) as exc:
        log.error("kaizen: %s", exc)
        return 2
