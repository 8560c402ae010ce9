"""`kaizen models pull [NAME]`: build an embedded base model's Hugging Face directory under the data directory."""

from __future__ import annotations

import argparse
import logging

from gateway.commands.options import add_common_options, configure_logging, load_settings

log = logging.getLogger("kaizen")


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    models = commands.add_parser("models", help="Base models.")
    models_commands = models.add_subparsers(dest="models_command", required=True)
    pull = models_commands.add_parser(
        "pull", help="Build an embedded model's Hugging Face directory under the data directory (idempotent)."
    )
    pull.add_argument("name", nargs="?", default="smollm2-135m-instruct")
    add_common_options(pull)
    pull.set_defaults(func=pull_command)


def pull_command(args: argparse.Namespace) -> int:
    from gateway.base_models import pull_base_model

    settings = load_settings(args)
    configure_logging(settings.log_level)
    path = pull_base_model(args.name, settings.data_dir / "models")
    log.info("%s is ready at %s", args.name, path)
    return 0
