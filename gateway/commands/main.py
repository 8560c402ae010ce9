"""The `kaizen` command line. Every settings field is also a flag of `kaizen serve` (documented by --help)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import sys
import types
import typing
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo

from gateway.commands.bootstrap import add_bootstrap_arguments
from gateway.commands.datasets import add_export_arguments, add_import_arguments
from gateway.commands.judge import add_judge_arguments
from gateway.demo.tasks import TASKS
from gateway.settings import Settings
from trainer.control.signals import SigtermAsCtrlC

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


async def _has_managed_keys(database_url: str) -> bool:
    """Whether the database holds managed keys (then the gateway is not open, whatever the environment says).

    A database that does not exist or is not migrated yet holds none."""
    from storage.database import Database
    from storage.keys import list_keys

    database = Database(database_url)
    try:
        async with database.session() as session:
            return bool(await list_keys(session))
    except Exception:  # no file, no table, unreachable: no managed keys to rely on
        return False
    finally:
        await database.dispose()


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import build_services, create_app
    from gateway.exposure import open_exposure
    from gateway.http_protocol import OpenAIHttpToolsProtocol
    from migrations.runner import upgrade_database

    settings = load_settings(args)
    configure_logging(settings.log_level)
    refusal = open_exposure(settings)
    if refusal is not None and not asyncio.run(_has_managed_keys(settings.database_url)):
        log.error("%s", refusal)
        return 2
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
        http=OpenAIHttpToolsProtocol,
        log_level=settings.log_level,
        access_log=False,
        timeout_graceful_shutdown=30,
    )
    return 0


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from migrations.runner import upgrade_database

    settings = load_settings(args)
    configure_logging(settings.log_level)
    asyncio.run(upgrade_database(settings.database_url, args.revision))
    log.info("database is at revision %s", args.revision)
    return 0


def settings_table() -> str:
    """Every setting as a Markdown table (docs/configuration.md's settings section is this output)."""
    lines = ["| environment variable | default | meaning |", "|---|---|---|"]
    for name, info in Settings.model_fields.items():
        default = info.get_default(call_default_factory=True)
        shown = ",".join(default) if isinstance(default, list) else str(default)
        lines.append(f"| `KAIZEN_{name.upper()}` | `{shown}` | {info.description} |")
    return "\n".join(lines)


def cmd_models_pull(args: argparse.Namespace) -> int:
    from gateway.base_models import pull_base_model

    settings = load_settings(args)
    configure_logging(settings.log_level)
    path = pull_base_model(args.name, settings.data_dir / "models")
    log.info("%s is ready at %s", args.name, path)
    return 0


def cmd_policy_create(args: argparse.Namespace) -> int:
    from gateway.policies import create_policy_with_initial_adapter
    from migrations.runner import open_database

    settings = load_settings(args)
    configure_logging(settings.log_level)
    config = json.loads(args.policy_config.read_text()) if args.policy_config else None

    async def run() -> None:
        async with open_database(settings.database_url) as database:
            policy = await create_policy_with_initial_adapter(
                database,
                settings.data_dir,
                args.name,
                settings.base_model,
                config,
                actor="cli",
                exist_ok=args.exist_ok,
            )
        log.info(
            "policy %s: base %s, active version %s", policy.name, policy.base_model, policy.active_version
        )

    asyncio.run(run())
    return 0


def cmd_policy_list(args: argparse.Namespace) -> int:
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
                lines.append(
                    f"{policy.name}\tbase={policy.base_model}\tactive={policy.active_version}\t{versions}"
                )
            return lines

    sys.stdout.write("".join(line + "\n" for line in asyncio.run(run())))
    return 0


def cmd_judge(args: argparse.Namespace) -> int:
    from gateway.commands.judge import run_judge

    settings = load_settings(args)
    configure_logging(settings.log_level)
    return run_judge(settings, args.policy, args.since, args.limit)


def cmd_train(args: argparse.Namespace) -> int:
    """One GRPO run of a policy, in this process: `python -m trainer.learner` with its arguments taken from the
    settings. Exits 0 when a candidate was written, 3 when nothing was."""
    from gateway.base_models import resolve_base_model
    from gateway.commands.judge import judge_settings, parse_since
    from gateway.scheduling import gate_url
    from trainer.learner.engine_sampling import EngineEndpoint
    from trainer.learner.train_command import NO_CANDIDATE, TrainingInputs, parse_overrides, train_policy

    settings = load_settings(args)
    configure_logging(settings.log_level)
    if settings.train_processes > 1:
        return train_on_several_processes(args, settings)
    engine = None
    if settings.train_sampler == "engine" and settings.engine_sleep_during_training:
        log.info("the engine sleeps while training runs: resampling with the trainer's own model")
    elif settings.train_sampler == "engine":
        # The scheduler's training child inherits the gateway's KAIZEN_* settings: this is that gateway's URL.
        engine = EngineEndpoint(
            gate_url(settings), settings.api_keys[0] if settings.api_keys else None, max_n=settings.max_n
        )
    inputs = TrainingInputs(
        policy=args.policy,
        database_url=settings.database_url,
        data_dir=settings.data_dir,
        judge=judge_settings(settings),
        overrides=parse_overrides(args.set or []),
        since=parse_since(args.since) if args.since else None,
        engine=engine,
        webhook_secret=settings.feedback_secret,
        device=args.device,
    )
    models_dir = settings.data_dir / "models"
    outcome = asyncio.run(train_policy(inputs, lambda name: resolve_base_model(name, models_dir)))
    return 0 if outcome.status == "succeeded" else NO_CANDIDATE


def cmd_bootstrap(args: argparse.Namespace) -> int:
    """Cold start: scenarios written for a task, attempted through the gateway, scored and trained on."""
    from gateway.commands.bootstrap import run_bootstrap

    settings = load_settings(args)
    configure_logging(settings.log_level)
    for chatty in ("httpx", "openai", "LiteLLM"):  # one line per request would bury the progress
        logging.getLogger(chatty).setLevel(logging.WARNING)
    return run_bootstrap(settings, args)


def train_on_several_processes(args: argparse.Namespace, settings: Settings) -> int:
    """`kaizen train` with KAIZEN_TRAIN_PROCESSES > 1: the scheduler's training child, through torchrun, in the
    foreground (its exit status is the run's)."""
    import subprocess

    from gateway.base_models import resolve_base_model
    from gateway.commands.judge import parse_since
    from gateway.scheduling import child_env, train_command
    from migrations.runner import open_database
    from storage.policies import get_policy

    async def base_model_of_policy() -> str | None:
        async with open_database(settings.database_url) as database, database.session() as session:
            policy = await get_policy(session, args.policy)
        return policy.base_model if policy is not None else None

    base_model = asyncio.run(base_model_of_policy())
    if base_model is None:
        print(f"kaizen train: no policy named {args.policy!r}", file=sys.stderr)
        return 2
    argv = [
        *train_command(settings),
        "--policy",
        args.policy,
        "--base-model",
        resolve_base_model(base_model, settings.data_dir / "models"),
    ]
    if args.since:
        argv += ["--since", parse_since(args.since).isoformat()]
    for item in args.set or []:
        argv += ["--set", item]
    if args.device:
        argv += ["--device", args.device]
    # In a session of its own, torchrun hears of a stop only from here, and once: a terminal's Ctrl-C and a
    # supervisor's SIGTERM both reach this process as KeyboardInterrupt and are passed on as one SIGTERM, which
    # torchrun hands to every trainer (rank 0 records the run failed) before it exits itself.
    torchrun = subprocess.Popen(argv, env=child_env(settings), start_new_session=True)
    try:
        return torchrun.wait()
    except KeyboardInterrupt:
        torchrun.send_signal(signal.SIGTERM)
        torchrun.wait()
        raise


def cmd_policy_switch(args: argparse.Namespace) -> int:
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


def cmd_keys(args: argparse.Namespace) -> int:
    """`kaizen keys create|list|revoke`: managed API keys, one JSON object a line on stdout. A created
    key's secret is printed once; gateways pick changes up within `KAIZEN_POLICY_REFRESH_S`."""
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


def cmd_audit(args: argparse.Namespace) -> int:
    """`kaizen audit`: the newest audit entries, one JSON object a line."""
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


def cmd_worker(args: argparse.Namespace) -> int:
    """Run the policies' schedules without serving (set KAIZEN_SCHEDULER=false on the gateways), or with
    `--once KIND` run one job of each policy (or of `--policy`) now and exit."""
    from gateway.commands.worker import run_once, run_worker

    settings = load_settings(args)
    configure_logging(settings.log_level)
    if args.once:
        return run_once(settings, args.once, args.policy)
    return run_worker(settings)


def cmd_demo(args: argparse.Namespace) -> int:
    import tempfile

    from gateway.demo.runner import DemoOptions, demo_main

    settings = load_settings(args)
    configure_logging(settings.log_level)
    for chatty in ("httpx", "openai"):  # one line per request would bury the cycle reports
        logging.getLogger(chatty).setLevel(logging.WARNING)
    out: Path | None = args.out
    data_dir = out / "data" if out is not None else Path(tempfile.mkdtemp(prefix="kaizen-demo-"))
    options = DemoOptions(
        out=out,
        data_dir=data_dir,
        models_dir=settings.data_dir / "models",
        base_model=settings.base_model,
        minutes=args.minutes,
        cycle_calls=args.cycle_calls,
        rate=args.rate,
        concurrency=args.concurrency,
        seed=args.seed,
        task=args.task,
        stop_at_target=args.stop_at_target,
    )
    return demo_main(options)


def cmd_export(args: argparse.Namespace) -> int:
    from gateway.commands.datasets import run_export

    settings = load_settings(args)
    configure_logging(settings.log_level)
    return run_export(settings, args)


def cmd_import(args: argparse.Namespace) -> int:
    from gateway.commands.datasets import run_import

    settings = load_settings(args)
    configure_logging(settings.log_level)
    return run_import(settings, args)


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

    models = commands.add_parser("models", help="Base models.")
    models_commands = models.add_subparsers(dest="models_command", required=True)
    pull = models_commands.add_parser(
        "pull", help="Build an embedded model's Hugging Face directory under the data directory (idempotent)."
    )
    pull.add_argument("name", nargs="?", default="smollm2-135m-instruct")
    add_settings_flags(pull)
    pull.set_defaults(func=cmd_models_pull)

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
    add_settings_flags(create)
    create.set_defaults(func=cmd_policy_create)
    promote = policy_commands.add_parser("promote", help="Make version N the active version of a policy.")
    promote.add_argument("name")
    promote.add_argument("version", type=int)
    add_settings_flags(promote)
    promote.set_defaults(func=cmd_policy_switch)
    rollback = policy_commands.add_parser("rollback", help="Re-activate the previously active version.")
    rollback.add_argument("name")
    add_settings_flags(rollback)
    rollback.set_defaults(func=cmd_policy_switch)
    listing = policy_commands.add_parser("list", help="List policies and their versions.")
    add_settings_flags(listing)
    listing.set_defaults(func=cmd_policy_list)

    judge = commands.add_parser(
        "judge", help="Score unscored groups of a policy's episodes (RULER or the policy's scorer)."
    )
    add_judge_arguments(judge)
    add_settings_flags(judge)
    judge.set_defaults(func=cmd_judge)

    train = commands.add_parser(
        "train",
        help="Train a policy once with GRPO on its rewarded episodes; writes version N+1 (candidate).",
    )
    train.add_argument("--policy", required=True, help="Policy to train.")
    train.add_argument(
        "--since", help="Only episodes created since (24h, 7d, ISO); default: since the last run."
    )
    train.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="Override a TrainConfig field for this run."
    )
    train.add_argument("--device", help="torch device (default: cuda when available, else cpu).")
    add_settings_flags(train)
    train.set_defaults(func=cmd_train)

    bootstrap = commands.add_parser(
        "bootstrap",
        help="Cold start a policy without traffic: a model writes scenarios for --task, the policy attempts "
        "each through the gateway (episodes of source `bootstrap`), its scorer scores them, and it trains.",
    )
    add_bootstrap_arguments(bootstrap)
    add_settings_flags(bootstrap)
    bootstrap.set_defaults(func=cmd_bootstrap)

    worker = commands.add_parser(
        "worker", help="Run the policies' scheduled jobs (judge, train, retention) without serving."
    )
    worker.add_argument(
        "--once",
        choices=["judge", "train", "retention"],
        help="Run this job now for every policy (or --policy) and exit; prints one JSON line per run.",
    )
    worker.add_argument("--policy", help="With --once: only this policy.")
    add_settings_flags(worker)
    worker.set_defaults(func=cmd_worker)

    demo = commands.add_parser(
        "demo",
        help="Run the whole learning loop on this machine: a simulated app's traffic, feedback, scheduled "
        "training, the gate and hot reload; prints each cycle's serving version and mean reward.",
    )
    demo.add_argument(
        "--out", type=Path, help="Write demo.json, demo.png and the gateway log here (and keep its data)."
    )
    demo.add_argument("--minutes", type=float, default=20.0, help="How long the traffic runs at most.")
    demo.add_argument(
        "--stop-at-target",
        action="store_true",
        help="End as soon as a cycle answered by a trained version reaches the task's target reward.",
    )
    demo.add_argument(
        "--cycle-calls", type=int, default=60, help="Calls per reported cycle (60: every question once)."
    )
    demo.add_argument("--rate", type=float, default=0.5, help="Calls per second the simulated app sends.")
    demo.add_argument("--concurrency", type=int, default=8, help="Most calls the app has in flight at once.")
    demo.add_argument("--seed", type=int, default=0, help="Seeds the question order and training.")
    demo.add_argument(
        "--task",
        choices=sorted(TASKS),
        default="opposites",
        help="What the simulated app asks (gateway/demo/tasks.py): `opposites`, which the base model gets "
        "right now and then, or `past-tense`, where its successes are rare.",
    )
    add_settings_flags(demo)
    demo.set_defaults(func=cmd_demo)

    keys = commands.add_parser("keys", help="Managed API keys: create, list, revoke.")
    keys_commands = keys.add_subparsers(dest="keys_command", required=True)
    key_create = keys_commands.add_parser("create", help="Create a key; prints its secret once.")
    key_create.add_argument("name", help="What the key is for (shown in lists and the audit log).")
    key_create.add_argument(
        "--scope",
        action="append",
        choices=["chat", "feedback", "read", "admin"],
        help="A scope the key has (repeat; default: chat, feedback, read).",
    )
    # "default" is storage.models.DEFAULT_PROJECT, not imported here: the CLI starts without SQLAlchemy.
    key_create.add_argument("--project", default="default", help="The project whose data the key sees.")
    key_create.add_argument(
        "--model", action="append", help="A model or policy the key may call (repeat; default: any)."
    )
    key_list = keys_commands.add_parser("list", help="List keys (never their secrets).")
    key_list.add_argument("--all", action="store_true", help="Include revoked keys.")
    key_revoke = keys_commands.add_parser("revoke", help="Revoke a key by its id.")
    key_revoke.add_argument("key_id")
    for sub in (key_create, key_list, key_revoke):
        add_settings_flags(sub)
        sub.set_defaults(func=cmd_keys)

    audit = commands.add_parser(
        "audit", help="List audit entries (promotions, key changes, ...), newest first."
    )
    audit.add_argument("--action", help="Only this action, e.g. policy.promote or key.revoke.")
    audit.add_argument("--target", help="Only this target (a policy name, a key id).")
    audit.add_argument("--limit", type=int, default=100)
    add_settings_flags(audit)
    audit.set_defaults(func=cmd_audit)

    export = commands.add_parser(
        "export",
        help="Write episodes (messages, tools, rewards, provenance) to Parquet or JSON lines, in Kaizen's schema "
        "or OpenAI's fine-tuning chat format; streamed, with a progress bar.",
    )
    add_export_arguments(export)
    add_settings_flags(export)
    export.set_defaults(func=cmd_export)

    importing = commands.add_parser(
        "import",
        help="Store conversations (OpenAI chat JSON lines, optionally rewarded) as episodes of a policy "
        "(source `import`); validated first, idempotent.",
    )
    add_import_arguments(importing)
    add_settings_flags(importing)
    importing.set_defaults(func=cmd_import)

    settings = commands.add_parser(
        "settings", help="Print every setting with its default, as a Markdown table."
    )
    settings.set_defaults(func=cmd_settings)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    interrupt = SigtermAsCtrlC()
    try:
        with contextlib.ExitStack() as stack:
            # `serve` leaves SIGTERM to uvicorn: a graceful stop, then death by the signal, which service
            # managers count as a clean stop. The long-running worker and the demo install handlers of their own
            # while their loop runs, which take over from this one.
            if args.command != "serve":
                stack.enter_context(interrupt)
            return int(args.func(args))
    except KeyboardInterrupt:
        log.warning("%s stopped by %s", args.command, interrupt.signal.name)
        return interrupt.exit_status
    except (FileNotFoundError, ValueError) as exc:
        log.error("%s", exc)
        return 2
