"""`kaizen serve`: the gateway (every setting is one of its flags), and `kaizen settings`, which lists them."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from gateway.commands.options import add_every_setting, configure_logging, load_settings, settings_table

log = logging.getLogger("kaizen")


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = commands.add_parser("serve", help="Run the gateway (applies online-safe migrations first).")
    add_every_setting(serve)
    serve.set_defaults(func=serve_command)
    listing = commands.add_parser(
        "settings", help="Print every setting with its default, as a Markdown table."
    )
    listing.set_defaults(func=settings_command)


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


def serve_command(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import build_services, create_app
    from gateway.exposure import open_exposure
    from gateway.http_protocol import http_protocol
    from gateway.machine import slow_interpreter_note
    from migrations.runner import upgrade_database

    settings = load_settings(args)
    configure_logging(settings.log_level)
    if (note := slow_interpreter_note()) is not None:
        log.warning("%s", note)
    refusal = open_exposure(settings)
    if refusal is not None and not asyncio.run(_has_managed_keys(settings.database_url)):
        log.error("%s", refusal)
        return 2
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    log.info("applying database migrations (%s)", settings.database_url.split("@")[-1])
    # Online-safe migrations only: one that is not is refused (with what to do), as other replicas may still serve.
    asyncio.run(upgrade_database(settings.database_url, by="kaizen serve"))
    workers = settings.serving_workers()
    if workers > 1:
        from gateway.workers import serve_workers

        return serve_workers(settings, workers)
    app = create_app(build_services(settings))
    log.info("serving on http://%s:%d/v1 (engine: %s)", settings.host, settings.port, settings.engine)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http=http_protocol(settings),
        log_level=settings.log_level,
        access_log=False,
        timeout_graceful_shutdown=30,
    )
    return 0


def settings_command(_: argparse.Namespace) -> int:
    sys.stdout.write(settings_table() + "\n")
    return 0
