"""A consistent snapshot of the database while the gateway writes to it, and its restore.

- **SQLite:** the online backup API (`sqlite3.Connection.backup`) in a single step: one read transaction, so the
  copy is the database as of one commit, while the capture writer goes on committing (WAL mode lets it). Copied
  in several steps, SQLite would start over after every commit of another connection, and a gateway under load
  commits every few milliseconds.
- **PostgreSQL:** `pg_dump --format=custom` on a snapshot that a repeatable-read transaction of this process
  exports (`pg_export_snapshot`), so the schema revision and the adapter versions it reads are those of the dump;
  `pg_restore` in a single transaction puts it back.

Both read what the backup needs from the snapshot itself (`Contents`): the schema revision and every adapter
version the database names, whose files are then copied.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import glob
import logging
import os
import shutil
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine

from gateway.backup.errors import BackupError
from gateway.backup.manifest import DatabaseKind
from gateway.backup.progress import file_size, mib, ticking
from storage.wal_checkpoints import sqlite_path

log = logging.getLogger("kaizen")

_VERSIONS = text(
    "SELECT p.name, p.active_version, a.version, a.status, a.path FROM policies p "
    "LEFT JOIN adapters a ON a.policy_id = p.id ORDER BY p.name, a.version"
)
# Tables and views a restore would collide with: the target's own schema (the first of its search path).
_PG_RELATIONS = text(
    "SELECT c.relname, c.relkind::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
    "WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p', 'v', 'm') AND NOT c.relispartition "
    "ORDER BY c.relname"
)
_SQLITE_RELATIONS = text("SELECT name, type FROM sqlite_master WHERE type IN ('table', 'view') ORDER BY name")


@dataclass(frozen=True)
class StoredVersion:
    """An adapter version as the database names it; `path` is where the adapter store held its files."""

    policy: str
    version: int
    status: str
    path: str


@dataclass(frozen=True)
class Contents:
    """What a snapshot holds that the rest of the backup depends on."""

    revision: str
    active_versions: dict[str, int | None]
    versions: list[StoredVersion]


def database_kind(url: str) -> DatabaseKind:
    backend = make_url(url).get_backend_name()
    if backend == "sqlite":
        return "sqlite"
    if backend == "postgresql":
        return "postgresql"
    raise BackupError(f"backups cover SQLite and PostgreSQL databases, not {backend}")


def sqlite_file(url: str) -> Path:
    try:
        return Path(sqlite_path(url))
    except ValueError as exc:
        raise BackupError("an in-memory SQLite database cannot be backed up or restored") from exc


async def read_contents(connection: AsyncConnection) -> Contents:
    try:
        revision = await connection.scalar(text("SELECT version_num FROM alembic_version"))
    except DBAPIError as exc:
        raise BackupError(
            "the database holds no Kaizen schema (no alembic_version table): nothing to back up"
        ) from exc
    active: dict[str, int | None] = {}
    versions = []
    for name, active_version, version, status, path in await connection.execute(_VERSIONS):
        active[name] = active_version
        if version is not None:
            versions.append(StoredVersion(name, version, status, path))
    return Contents(str(revision), active, versions)


def _reason(exc: BaseException) -> str:
    """The driver's own message, without SQLAlchemy's statement and link (and never a URL with its password)."""
    return str(exc.orig if isinstance(exc, DBAPIError) else exc).strip()


# ---------------------------------------------------------------------------------------------- snapshots
async def snapshot_sqlite(url: str, target: Path) -> Contents:
    source = sqlite_file(url)
    if not source.is_file():
        raise BackupError(f"no SQLite database at {source}")
    log.info(
        "copying the SQLite database %s (%s) with the online backup API", source, mib(_sqlite_size(source))
    )
    started = time.monotonic()
    async with ticking("copying the database", target):
        try:
            await asyncio.to_thread(_sqlite_backup, source, target)
        except sqlite3.Error as exc:
            raise BackupError(f"could not copy the SQLite database {source}: {exc}") from exc
    log.info("database copied: %s in %.1f s", mib(file_size(target)), time.monotonic() - started)
    engine = create_async_engine(f"sqlite+aiosqlite:///{target}")
    try:
        async with engine.connect() as connection:
            return await read_contents(connection)
    finally:
        await engine.dispose()


def _sqlite_size(path: Path) -> int:
    wal = path.with_name(path.name + "-wal")
    return path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)


def _sqlite_backup(source: Path, target: Path) -> None:
    reader = sqlite3.connect(source, timeout=30)
    try:
        writer = sqlite3.connect(target)
        try:
            reader.backup(writer)  # every page in one step: one read transaction, one consistent copy
            # A file of its own: no write-ahead log beside it (the gateway turns WAL on again when it opens it).
            writer.execute("PRAGMA journal_mode=DELETE")
        finally:
            writer.close()
    finally:
        reader.close()


async def snapshot_postgres(url: str, target: Path, bin_dir: str) -> Contents:
    pg_dump = find_tool("pg_dump", bin_dir)
    engine = create_async_engine(url)
    try:
        async with engine.connect() as plain:
            connection = await plain.execution_options(isolation_level="REPEATABLE READ")
            async with connection.begin():
                snapshot = await connection.scalar(text("SELECT pg_export_snapshot()"))
                contents = await read_contents(connection)
                log.info("dumping the PostgreSQL database with %s", pg_dump)
                started = time.monotonic()
                await run_tool(
                    [
                        pg_dump,
                        "--format=custom",
                        "--no-password",
                        f"--snapshot={snapshot}",
                        f"--file={target}",
                    ],
                    libpq_environment(url),
                    "pg_dump",
                    growing=target,
                )
        log.info("database dumped: %s in %.1f s", mib(file_size(target)), time.monotonic() - started)
        return contents
    except (OSError, DBAPIError) as exc:
        raise BackupError(f"could not read the PostgreSQL database: {_reason(exc)}") from exc
    finally:
        await engine.dispose()


# ---------------------------------------------------------------------------------------------- restores
async def relations(url: str) -> list[str]:
    """The tables and views of the target database (its current schema on PostgreSQL): empty means nothing a
    restore would overwrite."""
    if database_kind(url) == "sqlite":
        path = sqlite_file(url)
        if not path.is_file() or not path.stat().st_size:
            return []
    engine = create_async_engine(url)
    try:
        async with engine.connect() as connection:
            query = _PG_RELATIONS if connection.dialect.name == "postgresql" else _SQLITE_RELATIONS
            return [name for name, _ in await connection.execute(query)]
    except (OSError, DBAPIError) as exc:
        raise BackupError(f"could not read the target database: {_reason(exc)}") from exc
    finally:
        await engine.dispose()


def restore_sqlite(snapshot: Path, url: str) -> None:
    """Put the snapshot in the database file's place (through a rename, so a failed copy leaves no half file),
    and remove a write-ahead log left beside the file it replaces, which belongs to that file only."""
    target = sqlite_file(url)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".restoring")
    shutil.copyfile(snapshot, partial)
    for suffix in ("-wal", "-shm", "-journal"):
        target.with_name(target.name + suffix).unlink(missing_ok=True)
    os.replace(partial, target)


async def restore_postgres(dump: Path, url: str, bin_dir: str, *, drop_first: bool) -> None:
    """`pg_restore` in one transaction (a failure leaves the target as it was), after dropping the target's
    tables and views when `drop_first` (`--force`)."""
    pg_restore = find_tool("pg_restore", bin_dir)
    if drop_first:
        await _drop_relations(url)
    log.info("restoring the PostgreSQL database with %s", pg_restore)
    started = time.monotonic()
    await run_tool(
        [
            pg_restore,
            "--no-password",
            "--no-owner",
            "--no-privileges",
            "--exit-on-error",
            "--single-transaction",
            f"--dbname={make_url(url).database}",
            str(dump),
        ],
        libpq_environment(url),
        "pg_restore",
    )
    log.info("database restored in %.1f s", time.monotonic() - started)


async def _drop_relations(url: str) -> None:
    engine = create_async_engine(url)
    try:
        async with engine.begin() as connection:
            found = list(await connection.execute(_PG_RELATIONS))
            quote = connection.dialect.identifier_preparer.quote
            # Views first: they depend on the tables. Dropping a partitioned table drops its partitions.
            for name, kind in sorted(found, key=lambda row: row[1] not in ("v", "m")):
                what = {"v": "VIEW", "m": "MATERIALIZED VIEW"}.get(kind, "TABLE")
                await connection.execute(text(f"DROP {what} IF EXISTS {quote(name)} CASCADE"))
            log.warning("dropped the %d tables and views of the target database (--force)", len(found))
    finally:
        await engine.dispose()


# ---------------------------------------------------------------------------------------------- PostgreSQL tools
def find_tool(name: str, bin_dir: str) -> str:
    """`pg_dump` or `pg_restore`: in `bin_dir` when set, else on PATH, else the newest Debian/Ubuntu install."""
    if bin_dir:
        candidate = Path(bin_dir) / name
        if os.access(candidate, os.X_OK):
            return str(candidate)
        raise BackupError(f"{name} not found in {bin_dir} (KAIZEN_PG_BIN_DIR)")
    on_path = shutil.which(name)
    if on_path:
        return on_path
    installed = sorted(
        glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
        key=lambda found: int(found.split("/")[-3]) if found.split("/")[-3].isdigit() else 0,
    )
    if installed:
        return installed[-1]
    raise BackupError(
        f"{name} not found on PATH nor in /usr/lib/postgresql/*/bin: install PostgreSQL's client programs "
        "(at least the server's major version; Debian: postgresql-client) or set KAIZEN_PG_BIN_DIR"
    )


def libpq_environment(url: str) -> dict[str, str]:
    """The connection of `url` as libpq's environment variables: a password in argv would show in `ps`."""
    parsed = make_url(url)
    values: dict[str, object] = {
        "PGHOST": parsed.host,
        "PGPORT": parsed.port,
        "PGUSER": parsed.username,
        "PGPASSWORD": parsed.password,
        "PGDATABASE": parsed.database,
    }
    query = {key: value for key, value in parsed.query.items() if isinstance(value, str)}
    if "host" in query:  # a Unix socket directory
        values["PGHOST"] = query["host"]
    if "sslmode" in query or "ssl" in query:
        mode = query.get("sslmode") or query["ssl"]
        values["PGSSLMODE"] = "require" if mode == "true" else mode
    return {**os.environ, **{key: str(value) for key, value in values.items() if value}}


async def run_tool(argv: list[str], env: dict[str, str], what: str, growing: Path | None = None) -> None:
    """Run a PostgreSQL client program; its messages are logged, and a failure raises `BackupError` with them."""
    process = await asyncio.create_subprocess_exec(
        *argv,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    said: collections.deque[str] = collections.deque(maxlen=10)

    async def read_messages() -> None:
        assert process.stderr is not None
        async for raw in process.stderr:
            line = raw.decode(errors="replace").rstrip()
            if line:
                said.append(line)
                log.warning("%s", line)

    try:
        async with ticking(what, growing):
            await asyncio.gather(read_messages(), process.wait())
    finally:
        if process.returncode is None:  # interrupted: the program must not outlive the command
            process.kill()
            with contextlib.suppress(ProcessLookupError):
                await process.wait()
    if process.returncode:
        raise BackupError(f"{what} failed with status {process.returncode}: " + " / ".join(said))
