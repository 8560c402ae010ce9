"""Apply Alembic migrations programmatically (`kaizen db upgrade`, and `kaizen serve` at start), and open a
migrated database for the one-shot commands.

An upgrade first makes a plan: the database's revision and the migrations this code would apply, each with its
online safety (`migrations.online`). Online-safe ones are applied while the previous revision's gateways keep
serving; a plan that holds an offline one is refused unless the caller says every gateway and worker is stopped
(`kaizen db upgrade --gateways-stopped`). An empty database takes every migration (nothing serves it yet).

A database newer than this code (a rolling upgrade migrated it for the next version) is not an error: when the
revisions it went through since this code's head were all online-safe (`schema_revisions`), this code serves on it
and says so; otherwise it refuses, naming the revision that needs the newer code.

It lives beside the migrations it runs, so the dependency points one way: migrations use storage's models,
storage never imports migrations.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import Script, ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import Connection, insert, inspect, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import create_async_engine

from migrations.online import Offline, OnlineSafety
from storage.database import Database
from storage.models import SchemaRevision
from storage.partitions import ensure_partitions

log = logging.getLogger(__name__)

#: The PostgreSQL advisory lock key that serialises schema upgrades ("kaizen" in ASCII).
_MIGRATION_LOCK = 0x6B61697A656E
#: How long an online migration waits for a table lock on PostgreSQL. Behind a long query its lock request would
#: queue every other statement on that table (the serving gateways' included) until the query ended; it gives up
#: instead, and nothing is applied.
ONLINE_LOCK_TIMEOUT_S = 10
#: PostgreSQL's SQLSTATE for a lock not obtained within `lock_timeout`.
_LOCK_NOT_AVAILABLE = "55P03"
#: What an operator runs to apply migrations that need the gateways stopped.
OFFLINE_COMMAND = "kaizen db upgrade --gateways-stopped"


class MigrationRefused(ValueError):
    """The database cannot be brought to, or served at, the wanted revision without the operator: the message
    says what to do."""


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(Path(__file__).parent))
    config.set_main_option("sqlalchemy.url", url)
    return config


def known_revisions() -> list[str]:
    """The schema revisions this code can upgrade from, newest (the head) first."""
    scripts = ScriptDirectory.from_config(alembic_config(""))
    return [script.revision for script in scripts.walk_revisions()]


@dataclass(frozen=True)
class Migration:
    """One revision of `migrations/versions`, as an upgrade plan lists it."""

    revision: str
    title: str
    safety: OnlineSafety

    @classmethod
    def of(cls, script: Script) -> Migration:
        safety = getattr(script.module, "ONLINE_SAFETY", None)
        if safety is None:
            raise RuntimeError(f"migration {script.revision} does not declare ONLINE_SAFETY")
        return cls(script.revision, script.doc, safety)

    def describe(self, dialect: str) -> str:
        if not self.safety.safe_on(dialect):
            return f"{self.revision} ({self.title}): NOT online-safe: {self.safety.why}"
        if isinstance(self.safety, Offline):  # unsafe elsewhere only
            where = ", ".join(self.safety.dialects)
            return f"{self.revision} ({self.title}): online-safe on {dialect} (not on {where}: {self.safety.why})"
        return f"{self.revision} ({self.title}): online-safe: {self.safety.why}"


@dataclass(frozen=True)
class Plan:
    """What upgrading one database to `target` applies, oldest first."""

    dialect: str
    current: str | None  # the database's revision; None: an empty database
    target: str
    pending: tuple[Migration, ...]

    @property
    def offline(self) -> tuple[Migration, ...]:
        """The pending migrations that need every gateway stopped (none on an empty database: nothing serves it)."""
        if self.current is None:
            return ()
        return tuple(m for m in self.pending if not m.safety.safe_on(self.dialect))

    def lines(self) -> list[str]:
        """The plan as an operator reads it: where the database is, and each pending migration's verdict."""
        at = f"at revision {self.current}" if self.current else "empty"
        if not self.pending:
            return [f"the {self.dialect} database is {at}: nothing to apply for {self.target}"]
        head = f"the {self.dialect} database is {at}; {len(self.pending)} migration(s) to {self.target}:"
        return [head, *(f"  {m.describe(self.dialect)}" for m in self.pending)]

    def refusal(self, by: str) -> str:
        """Why `by` stops short of the plan, and what the operator does instead."""
        reasons = "; ".join(f"{m.revision} {m.safety.why}" for m in self.offline)
        return (
            f"{by} does not apply what is not safe while gateways of revision {self.current} serve: {reasons}. "
            f"Stop every `kaizen serve` and `kaizen worker` on this database, run `{OFFLINE_COMMAND}`, then start "
            "the gateways of this version."
        )


@dataclass(frozen=True)
class NewerDatabase:
    """The database is at a revision this code does not know: a later version upgraded it."""

    current: str
    head: str  # this code's newest revision
    #: The revisions recorded after `head`, oldest first; None when the record does not lead back to `head`.
    since: tuple[SchemaRevision, ...] | None

    @property
    def serves(self) -> bool:
        """Whether this code may serve on it: every revision since its head was online-safe."""
        return self.since is not None and all(r.online_safe for r in self.since)

    def verdict(self) -> str:
        """A warning when this code may serve on it; raises `MigrationRefused` when it may not."""
        if self.since is None:
            raise MigrationRefused(
                f"the database is at revision {self.current}, which this code (newest revision {self.head}) does "
                f"not know and which does not descend from {self.head}: run the Kaizen version that upgraded it"
            )
        unsafe = [r for r in self.since if not r.online_safe]
        if unsafe:
            first = unsafe[0]
            raise MigrationRefused(
                f"the database is at revision {self.current}, newer than this code ({self.head}), and "
                f"{first.revision} since then was not online-safe ({first.note}): this version cannot serve on "
                "it; run the version the database was upgraded for"
            )
        applied = ", ".join(r.revision for r in self.since)
        return (
            f"the database is at revision {self.current}, newer than this code ({self.head}); every revision "
            f"since ({applied}) was online-safe, so this code serves on it unchanged. Replace this gateway with "
            "the version the database was upgraded for."
        )


def _script(url: str) -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config(url))


def _recorded(connection: Connection) -> dict[str, SchemaRevision] | None:
    """The `schema_revisions` rows by revision; None before revision 0021 created the table."""
    if not inspect(connection).has_table(SchemaRevision.__tablename__):
        return None
    rows = connection.execute(select(SchemaRevision.__table__)).all()
    return {row.revision: SchemaRevision(**row._asdict()) for row in rows}


def _newer(connection: Connection, current: str, head: str) -> NewerDatabase:
    """Walk the recorded revisions back from the database's to this code's head."""
    recorded = _recorded(connection) or {}
    since: list[SchemaRevision] = []
    revision: str | None = current
    while revision is not None and revision != head and revision in recorded and len(since) <= len(recorded):
        since.append(recorded[revision])
        revision = recorded[revision].previous
    found = revision == head and bool(since)
    return NewerDatabase(current, head, tuple(reversed(since)) if found else None)


def read_plan(
    connection: Connection, script: ScriptDirectory, revision: str = "head"
) -> Plan | NewerDatabase:
    """What an upgrade of the database on `connection` to `revision` would do (nothing is changed)."""
    current = MigrationContext.configure(connection).get_current_revision()
    head = script.get_current_head()
    assert head is not None
    if current is not None and current not in {s.revision for s in script.walk_revisions()}:
        return _newer(connection, current, head)
    try:
        target = script.get_revision(revision)
    except CommandError as exc:
        raise MigrationRefused(
            f"no revision {revision!r} among this code's migrations (newest: {head})"
        ) from exc
    assert target is not None
    behind = {s.revision for s in script.iterate_revisions(current, "base")} if current else set()
    pending: list[Migration] = []
    if target.revision not in behind:
        pending = [Migration.of(s) for s in script.iterate_revisions(target.revision, current or "base")]
    return Plan(connection.dialect.name, current, target.revision, tuple(reversed(pending)))


def _record(connection: Connection, script: ScriptDirectory) -> None:
    """Add the revisions the database went through that `schema_revisions` lacks (once revision 0021 made it)."""
    recorded = _recorded(connection)
    current = MigrationContext.configure(connection).get_current_revision()
    if recorded is None or current is None:
        return
    dialect = connection.dialect.name
    now = datetime.now(UTC)
    rows = []
    for applied in script.iterate_revisions(current, "base"):
        if applied.revision not in recorded:
            safety = Migration.of(applied).safety
            previous = applied.down_revision
            assert previous is None or isinstance(previous, str), "the history is linear"
            rows.append(
                {
                    "revision": applied.revision,
                    "previous": previous,
                    "online_safe": safety.safe_on(dialect),
                    "note": safety.why,
                    "recorded_at": now,
                }
            )
    if rows:
        connection.execute(insert(SchemaRevision), rows)


def _apply(connection: Connection, url: str, plan: Plan, *, online: bool) -> None:
    """Apply the plan's migrations one at a time (in the caller's transaction), naming the one that fails."""
    config = alembic_config(url)
    config.attributes["connection"] = connection
    postgresql = connection.dialect.name == "postgresql"
    if online and postgresql:
        connection.execute(text(f"SET LOCAL lock_timeout = '{ONLINE_LOCK_TIMEOUT_S}s'"))
    for migration in plan.pending:
        log.info("applying %s (%s)", migration.revision, migration.title)
        try:
            command.upgrade(config, migration.revision)
        except DBAPIError as exc:
            if getattr(exc.orig, "sqlstate", None) != _LOCK_NOT_AVAILABLE:
                raise
            raise MigrationRefused(
                f"{migration.revision} waited more than {ONLINE_LOCK_TIMEOUT_S} s for a lock on a table that a "
                "long query or transaction holds (pg_stat_activity shows it); nothing was applied. Run the upgrade "
                "again once it has ended."
            ) from exc
    if online and postgresql:
        connection.execute(text("SET LOCAL lock_timeout TO DEFAULT"))


async def upgrade_database(
    url: str, revision: str = "head", *, gateways_stopped: bool = False, by: str = "this command"
) -> Plan | NewerDatabase:
    """Bring the database at `url` (an async SQLAlchemy URL) to `revision`, and return what was done.

    Raises `MigrationRefused` when a pending migration is not online-safe and `gateways_stopped` is false, or the
    database is newer than this code in a way it cannot serve; `by` names the caller in that message."""
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    script = _script(url)  # one for the plan and the record: each reads every migration file anew
    engine = create_async_engine(url)
    try:
        async with engine.begin() as connection:
            if connection.dialect.name == "postgresql":
                # Replicas started together upgrade one database: one at a time, the others then find it current.
                await connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK})

            def _upgrade(sync_connection: Connection) -> Plan | NewerDatabase:
                plan = read_plan(sync_connection, script, revision)
                if isinstance(plan, NewerDatabase):
                    log.warning("%s", plan.verdict())
                    return plan
                for line in plan.lines():
                    log.info("%s", line)
                if plan.offline and not gateways_stopped:
                    raise MigrationRefused(plan.refusal(by))
                _apply(sync_connection, url, plan, online=not gateways_stopped)
                _record(sync_connection, script)
                return plan

            done = await connection.run_sync(_upgrade)
            # Every start keeps the day partitions of `calls` (PostgreSQL) ready ahead of the clock.
            await ensure_partitions(connection, datetime.now(UTC).date())
    finally:
        await engine.dispose()
    return done


async def database_plan(url: str, revision: str = "head") -> Plan | NewerDatabase:
    """What `upgrade_database` would do now, changing nothing (`kaizen db status`)."""
    engine = create_async_engine(url)
    try:
        async with engine.connect() as connection:
            return await connection.run_sync(lambda sync: read_plan(sync, _script(url), revision))
    finally:
        await engine.dispose()


def upgrade_database_sync(url: str, revision: str = "head") -> None:
    asyncio.run(upgrade_database(url, revision))


@asynccontextmanager
async def open_database(url: str, *, migrate: bool = True) -> AsyncIterator[Database]:
    """A command's database: migrated to head first (unless `migrate` is off), disposed when the command ends."""
    if migrate:
        await upgrade_database(url)
    database = Database(url)
    try:
        yield database
    finally:
        await database.dispose()
