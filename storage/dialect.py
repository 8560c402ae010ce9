"""What differs between the two databases Kaizen runs on, SQLite and PostgreSQL, in one place."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Table
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession


def insert(session: AsyncSession, target: type[Any] | Table) -> Any:
    """INSERT for the session's database, which has `on_conflict_do_nothing` / `on_conflict_do_update`.

    `target` is a mapped class (ORM attribute names in `.values()`, e.g. `meta`) or a Table (column names,
    and no ORM bookkeeping: what the capture path's executemany wants).
    """
    if session.get_bind().dialect.name == "postgresql":
        return postgresql.insert(target)
    return sqlite.insert(target)
