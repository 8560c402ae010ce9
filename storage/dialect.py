"""What differs between the two databases Kaizen runs on, SQLite and PostgreSQL, in one place."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import BigInteger, ColumnElement, Table, cast, func
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import InstrumentedAttribute


def insert(session: AsyncSession, target: type[Any] | Table) -> Any:
    """INSERT for the session's database, which has `on_conflict_do_nothing` / `on_conflict_do_update`.

    `target` is a mapped class (ORM attribute names in `.values()`, e.g. `meta`) or a Table (column names,
    and no ORM bookkeeping: what the capture path's executemany wants).
    """
    if session.get_bind().dialect.name == "postgresql":
        return postgresql.insert(target)
    return sqlite.insert(target)


def utc(value: datetime) -> datetime:
    """SQLite hands timestamps back without their zone; every timestamp Kaizen writes is UTC."""
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def epoch_bucket(
    session: AsyncSession, column: ColumnElement[Any] | InstrumentedAttribute[Any], step_s: int
) -> ColumnElement[Any]:
    """The start of the `step_s`-second bucket a timestamp column falls in, as Unix seconds (UTC).

    SQLite stores timestamps as ISO text in UTC (`strftime('%s')` reads it); PostgreSQL as `timestamptz`.
    """
    if session.get_bind().dialect.name == "postgresql":
        seconds: ColumnElement[Any] = func.floor(func.extract("epoch", column) / step_s)
        return cast(seconds, BigInteger) * step_s
    epoch = cast(func.strftime("%s", column), BigInteger)
    return (epoch // step_s) * step_s
