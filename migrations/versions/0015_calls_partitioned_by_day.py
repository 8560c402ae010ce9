"""calls partitioned by day on PostgreSQL

Revision ID: 0015
Revises: 0012

On PostgreSQL `calls` becomes a table partitioned by range of `created_at`, one partition per UTC day, so
retention drops a day with one statement instead of deleting its rows one by one. Its primary key becomes
(id, created_at), as PostgreSQL requires the partition key in every unique constraint: a call id is still
generated unique, and the capture writer's idempotent write (a replayed record has the id and the time it had)
still finds it. The existing rows are copied into the new table, so on a large database this revision takes about
as long as copying `calls` once. Indexes other revisions put on `calls` and views that read it are carried over;
no foreign key may reference `calls` (none does: rewards may arrive before their call).

The partitioned table has no foreign key to `episodes`: deleting an episode would make PostgreSQL look for its
calls in every day partition (the episode id is not the partition key), which made dropping a day of 25,000
episodes take a minute. Nothing relies on it: the capture writer stores an episode before its calls, and episodes
are deleted only once they have no calls left. SQLite is unchanged. The indexes the trainer's and retention's
queries read (calls and episodes by policy and time) come from revision 0011.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from alembic import op

from migrations.online import Offline, OnlineSafety

revision: str = "0015"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ONLINE_SAFETY: OnlineSafety = Offline(
    "copies `calls` into a partitioned table under an exclusive lock: every read and write of `calls` "
    "waits until the whole table is copied, so feedback requests fail after 30 s and the capture backs up in "
    "the log",
    dialects=("postgresql",),
)

#: Day partitions created beyond today (the application keeps creating them ahead; see storage/partitions.py).
DAYS_AHEAD = 14
#: Older calls than this share one partition, rather than one per day.
DAYS_BACK = 400


def upgrade() -> None:
    connection = op.get_bind()
    if connection.dialect.name == "postgresql":
        _partition_calls(connection)


def downgrade() -> None:
    connection = op.get_bind()
    if connection.dialect.name == "postgresql":
        _unpartition_calls(connection)


def _dependent_views(connection: sa.Connection) -> list[tuple[str, str, str]]:
    """(name, kind, definition) of the views reading `calls`, directly or through other views, in an order
    they can be created in."""
    rows = connection.execute(
        sa.text(
            """
            WITH RECURSIVE dependents(oid, depth) AS (
                SELECT DISTINCT r.ev_class, 1 FROM pg_depend d JOIN pg_rewrite r ON r.oid = d.objid
                WHERE d.refobjid = 'calls'::regclass AND r.ev_class <> 'calls'::regclass
                UNION
                SELECT DISTINCT r.ev_class, dependents.depth + 1 FROM dependents
                JOIN pg_depend d ON d.refobjid = dependents.oid JOIN pg_rewrite r ON r.oid = d.objid
                WHERE r.ev_class <> dependents.oid
            )
            SELECT c.relname, c.relkind, pg_get_viewdef(c.oid), max(depth) AS depth
            FROM dependents JOIN pg_class c ON c.oid = dependents.oid
            GROUP BY c.relname, c.relkind, c.oid ORDER BY depth
            """
        )
    )
    return [(name, kind, definition) for name, kind, definition, _ in rows]


def _refuse_foreign_keys(connection: sa.Connection) -> None:
    referencing = connection.execute(
        sa.text(
            "SELECT conname, conrelid::regclass::text FROM pg_constraint WHERE confrelid = 'calls'::regclass"
        )
    ).all()
    if referencing:
        names = ", ".join(f"{name} on {table}" for name, table in referencing)
        raise RuntimeError(
            f"calls cannot be partitioned while foreign keys reference it ({names}): a partitioned table has no "
            "unique key on id alone. Reference calls by id without a foreign key, as rewards do."
        )


def _swap(connection: sa.Connection, partitioned: bool) -> None:
    """Build a new `calls` (partitioned or not) beside the old one, copy the rows, and drop the old one, keeping
    its indexes, foreign key and the views that read it."""
    _refuse_foreign_keys(connection)
    views = _dependent_views(connection)
    for name, kind, _ in reversed(views):
        connection.execute(sa.text(f'DROP {"MATERIALIZED VIEW" if kind == "m" else "VIEW"} "{name}"'))
    indexes = connection.execute(
        sa.text(
            "SELECT i.relname, pg_get_indexdef(i.oid) FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid "
            "WHERE x.indrelid = 'calls'::regclass AND NOT x.indisprimary"
        )
    ).all()
    execute = connection.execute
    execute(sa.text("ALTER TABLE calls RENAME TO calls_old"))
    execute(sa.text("ALTER TABLE calls_old DROP CONSTRAINT calls_pkey"))
    execute(sa.text("ALTER TABLE calls_old DROP CONSTRAINT IF EXISTS calls_episode_id_fkey"))
    for name, _ in indexes:
        execute(sa.text(f'DROP INDEX "{name}"'))
    suffix = " PARTITION BY RANGE (created_at)" if partitioned else ""
    execute(sa.text(f"CREATE TABLE calls (LIKE calls_old INCLUDING DEFAULTS INCLUDING CONSTRAINTS){suffix}"))
    key = "id, created_at" if partitioned else "id"
    execute(sa.text(f"ALTER TABLE calls ADD CONSTRAINT calls_pkey PRIMARY KEY ({key})"))
    if not partitioned:
        execute(
            sa.text(
                "ALTER TABLE calls ADD CONSTRAINT calls_episode_id_fkey FOREIGN KEY (episode_id) "
                "REFERENCES episodes (id) ON DELETE CASCADE"
            )
        )
    for _, definition in indexes:  # read before the rename, so they name `calls`
        execute(sa.text(definition.replace(" ON ONLY ", " ON ")))
    if partitioned:
        _create_partitions(connection)
    execute(sa.text("INSERT INTO calls SELECT * FROM calls_old"))
    execute(sa.text("DROP TABLE calls_old"))
    for name, kind, definition in views:
        kind_sql = "MATERIALIZED VIEW" if kind == "m" else "VIEW"
        execute(sa.text(f'CREATE {kind_sql} "{name}" AS {definition}'))


def _create_partitions(connection: sa.Connection) -> None:
    """One partition per UTC day from the oldest stored call (at most DAYS_BACK days ago; anything older goes to
    one partition of its own) to DAYS_AHEAD days from now, and the default one."""
    oldest = connection.execute(sa.text("SELECT min(created_at) FROM calls_old")).scalar()
    today = datetime.now(UTC).date()
    first = min(oldest.astimezone(UTC).date(), today) if oldest is not None else today
    if first < today - timedelta(days=DAYS_BACK):
        first = today - timedelta(days=DAYS_BACK)
        start = datetime(first.year, first.month, first.day, tzinfo=UTC)
        connection.execute(
            sa.text(
                f"CREATE TABLE calls_before_{first:%Y%m%d} PARTITION OF calls "
                f"FOR VALUES FROM (MINVALUE) TO ('{start.isoformat()}')"
            )
        )
    day = first
    while day <= today + timedelta(days=DAYS_AHEAD):
        lower = datetime(day.year, day.month, day.day, tzinfo=UTC)
        upper = lower + timedelta(days=1)
        connection.execute(
            sa.text(
                f"CREATE TABLE calls_{day:%Y%m%d} PARTITION OF calls "
                f"FOR VALUES FROM ('{lower.isoformat()}') TO ('{upper.isoformat()}')"
            )
        )
        day += timedelta(days=1)
    connection.execute(sa.text("CREATE TABLE calls_default PARTITION OF calls DEFAULT"))


def _partition_calls(connection: sa.Connection) -> None:
    _swap(connection, partitioned=True)


def _unpartition_calls(connection: sa.Connection) -> None:
    _swap(connection, partitioned=False)
