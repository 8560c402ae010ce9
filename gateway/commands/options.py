"""What every `kaizen` command shares: the settings options, logging, and time arguments.

Every command takes `--config`, `--data-dir` and `--database-url`; the other settings come from `KAIZEN_*`
variables and the TOML file. Only `kaizen serve` has a flag for each setting, since all of them configure it.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import types
import typing
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo

from gateway.settings import Settings

#: Settings every command takes as a flag, besides `--config`.
COMMON_SETTINGS = ("data_dir", "database_url")

_RELATIVE = re.compile(r"^(\d+)([mhdw])$")
_UNITS = {"m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


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


def _add_setting(parser: argparse.ArgumentParser, name: str) -> None:
    """One setting as a flag, with its description, environment variable and default."""
    info = Settings.model_fields[name]
    default = info.get_default(call_default_factory=True)
    shown = ",".join(default) if isinstance(default, list) else default
    text = f"{info.description} [env KAIZEN_{name.upper()}; default: {shown!s}]".replace("%", "%%")
    if info.annotation is bool:
        parser.add_argument(
            _flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None, help=text
        )
    else:
        parser.add_argument(
            _flag(name), dest=name, default=None, choices=_choices(info), type=_scalar_type(info), help=text
        )


def add_common_options(parser: argparse.ArgumentParser, *settings: str) -> None:
    """`--config`, `--data-dir`, `--database-url`, and the named settings this command is about."""
    parser.add_argument("--config", type=Path, help="TOML file with settings (keys are the field names).")
    for name in (*COMMON_SETTINGS, *settings):
        _add_setting(parser, name)


def add_every_setting(parser: argparse.ArgumentParser) -> None:
    """`kaizen serve`: every setting as a flag."""
    add_common_options(parser, *(name for name in Settings.model_fields if name not in COMMON_SETTINGS))


def load_settings(args: argparse.Namespace) -> Settings:
    """The settings: the command's flags over the environment over the TOML file over the defaults."""
    overrides = {name: getattr(args, name, None) for name in Settings.model_fields}
    return Settings.load(args.config, **overrides)


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )


def quiet_per_request_loggers(*names: str) -> None:
    """Long commands send many requests: a line per request would bury their progress."""
    for name in names:
        logging.getLogger(name).setLevel(logging.WARNING)


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


def settings_table() -> str:
    """Every setting as a Markdown table (docs/configuration.md's settings section is this output)."""
    lines = ["| environment variable | default | meaning |", "|---|---|---|"]
    for name, info in Settings.model_fields.items():
        default = info.get_default(call_default_factory=True)
        shown = ",".join(default) if isinstance(default, list) else str(default)
        lines.append(f"| `KAIZEN_{name.upper()}` | `{shown}` | {info.description} |")
    return "\n".join(lines)
