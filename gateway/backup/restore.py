"""`kaizen restore SRC`: put a backup back, into a fresh data directory and database (or over them, `--force`).

Nothing is written until every check passed: the manifest's files are all there with their sizes and SHA-256, the
backup's schema revision is one this code knows (a newer one needs a newer Kaizen), the target database is of the
backup's kind, no gateway runs on the target data directory, and the target is empty unless `--force`.

Then the database is restored and its schema upgraded to this code's (a backup of an older Kaizen); the adapter
files go to `<data_dir>/adapters` and every version's row is pointed at them (the rows name the store the backup
was taken from); the capture log's segments go to `<data_dir>/spool/log`, where the first gateway started on the
data directory stores them before it serves. Calls the database holds already are skipped there (the writer stores
a call id once), so no call is stored twice and none that was answered before the backup is missing.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from gateway.backup.databases import (
    database_kind,
    find_tool,
    relations,
    restore_postgres,
    restore_sqlite,
    sqlite_file,
)
from gateway.backup.errors import BackupError
from gateway.backup.manifest import ADAPTERS, CAPTURE, DATA, DATA_FILES, Manifest, read_manifest, verify_files
from gateway.backup.progress import Meter, mib
from gateway.backup.take import capture_log_files
from gateway.capture.directory import directories_in_use
from gateway.capture.writer import segment_numbers
from gateway.settings import Settings
from migrations.runner import known_revisions, upgrade_database
from storage.database import Database
from storage.policies import relocate_adapters

log = logging.getLogger("kaizen")


@dataclass(frozen=True)
class RestoreReport:
    database: str
    schema_revision: str  # the backup's
    upgraded_to: str  # the schema's now: this code's head
    active_versions: dict[str, int | None]
    adapter_versions: int
    capture_calls: int


def _occupied(data_dir: Path) -> list[str]:
    """What the target data directory holds that a restore would replace."""
    found = []
    adapters = data_dir / ADAPTERS
    if adapters.is_dir() and any(path.is_file() for path in adapters.rglob("*")):
        found.append(f"{adapters} holds adapter files")
    logs = capture_log_files(data_dir)
    if logs:
        found.append(f"{data_dir / 'spool'} holds {len(logs)} capture log files")
    found.extend(f"{data_dir / name} exists" for name in DATA_FILES if (data_dir / name).exists())
    return found


def _check_target(data_dir: Path) -> list[str]:
    running = directories_in_use(data_dir / "spool")
    if running:
        raise BackupError(
            f"a gateway is running on {data_dir} (it holds {running[0]}): stop every gateway and worker on the "
            "target before restoring"
        )
    return _occupied(data_dir)


def _restore_files(source: Path, manifest: Manifest, data_dir: Path, *, replace: bool) -> None:
    """Adapter files, capture log segments and data directory keys, into their places under `data_dir`."""
    log_dir = data_dir / "spool" / "log"
    if replace:
        shutil.rmtree(data_dir / ADAPTERS, ignore_errors=True)
        for path in capture_log_files(
            data_dir
        ):  # of the database being replaced: never to be stored in this one
            path.unlink(missing_ok=True)
    # Backup segments after any left (there are none unless --force found some it could not remove).
    first = max(segment_numbers(log_dir), default=-1) + 1
    entries = [
        entry for entry in manifest.files if PurePosixPath(entry.path).parts[0] in (ADAPTERS, CAPTURE, DATA)
    ]
    meter = Meter("copying files into the data directory", sum(entry.bytes for entry in entries))
    for entry in entries:
        parts = PurePosixPath(entry.path).parts
        if parts[0] == ADAPTERS:
            target = data_dir.joinpath(*parts)
        elif parts[0] == CAPTURE:
            target = log_dir / f"{first + int(PurePosixPath(entry.path).stem):012d}.jsonl"
        else:
            target = data_dir / parts[-1]
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / entry.path, target)
        meter.add(entry.bytes)


async def restore_backup(settings: Settings, source: Path, *, force: bool) -> RestoreReport:
    manifest = await asyncio.to_thread(read_manifest, source)
    known = known_revisions()
    if manifest.schema_revision not in known:
        raise BackupError(
            f"the backup's schema revision {manifest.schema_revision} is newer than this Kaizen knows (its newest "
            f"is {known[0]}): restore it with Kaizen {manifest.kaizen_version} or later"
        )
    url = settings.database_url
    kind = database_kind(url)
    if kind != manifest.database:
        raise BackupError(
            f"the backup holds a {manifest.database} database and the target is {kind}: restore it into a "
            f"{manifest.database} database (`kaizen export` and `kaizen import` move episodes between kinds)"
        )
    if kind == "postgresql":
        find_tool("pg_restore", settings.pg_bin_dir)
    log.info(
        "restoring the backup of %s (Kaizen %s, schema %s, %s)",
        manifest.created_at,
        manifest.kaizen_version,
        manifest.schema_revision,
        manifest.database,
    )
    await asyncio.to_thread(verify_files, source, manifest)
    occupied = await asyncio.to_thread(_check_target, settings.data_dir)
    tables = await relations(url)
    if tables:
        occupied.insert(
            0, f"the database holds {len(tables)} tables and views ({', '.join(tables[:3])}, ...)"
        )
    if occupied and not force:
        raise BackupError(
            "the target is not empty: "
            + "; ".join(occupied)
            + ". Restore into a fresh data directory and database, or pass --force to replace what is there"
        )
    if occupied:
        log.warning("--force: replacing what the target holds: %s", "; ".join(occupied))

    database_file = source / manifest.database_file
    if kind == "sqlite":
        await asyncio.to_thread(restore_sqlite, database_file, url)
        log.info("database restored to %s", sqlite_file(url))
    else:
        await restore_postgres(database_file, url, settings.pg_bin_dir, drop_first=bool(tables))
    if manifest.schema_revision != known[0]:
        log.info("upgrading the schema from revision %s to %s", manifest.schema_revision, known[0])
    # Nothing serves the restored database yet (a gateway on the target was refused above): every migration may run.
    await upgrade_database(url, gateways_stopped=True, by="kaizen restore")
    await asyncio.to_thread(_restore_files, source, manifest, settings.data_dir, replace=bool(occupied))
    database = Database(url)
    try:
        async with database.session() as session:
            await relocate_adapters(session, settings.data_dir)
            await session.commit()
    finally:
        await database.dispose()
    stored = sum(entry.in_backup for entry in manifest.adapters)
    log.info(
        "restored %d adapter versions (%s) into %s; active: %s",
        stored,
        mib(sum(entry.bytes for entry in manifest.files if entry.path.startswith(ADAPTERS + "/"))),
        settings.data_dir / ADAPTERS,
        ", ".join(f"{policy}@{version}" for policy, version in sorted(manifest.active_versions.items()))
        or "none",
    )
    missing = [f"{entry.policy}@{entry.version}" for entry in manifest.adapters if not entry.in_backup]
    if missing:
        log.warning(
            "the backup holds no files of %s: they cannot be served or trained from", ", ".join(missing)
        )
    if manifest.capture_calls:
        log.info(
            "%d calls of the capture log wait in %s: the first gateway started on %s stores them before it serves "
            "(those the database holds already are skipped)",
            manifest.capture_calls,
            settings.data_dir / "spool" / "log",
            settings.data_dir,
        )
    return RestoreReport(
        database=manifest.database,
        schema_revision=manifest.schema_revision,
        upgraded_to=known[0],
        active_versions=manifest.active_versions,
        adapter_versions=stored,
        capture_calls=manifest.capture_calls,
    )
