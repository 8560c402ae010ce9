"""The job lock: at most one job of a policy at a time (judge, train, retention), across processes and replicas.

The lock is a `job_locks` row per key (the policy's name): an insert that conflicts on the key means another
job of that policy is live. The holder renews `expires_at` from a heartbeat; a crashed holder stops, and the
next job takes the expired lock over. Insert-on-conflict works the same on SQLite and PostgreSQL.

A holder that starts a child process for the job (the scheduler's training child) hands the lock down by
naming its owner in the child's job (`TrainingJob.lock_owner`): the child renews the lock under that owner
instead of taking it, and leaves releasing it to the parent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import delete, update
from sqlalchemy.ext.asyncio import AsyncSession

from storage.database import Database
from storage.dialect import insert
from storage.models import JobLock

logger = logging.getLogger(__name__)


def lock_owner() -> str:
    """A holder's name, `host:pid:random`: unique per job, and says where a stuck lock's job ran."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _rowcount(result: Any) -> int:
    """Rows an INSERT/UPDATE touched (the generic `Result` type hides `CursorResult.rowcount`)."""
    return int(result.rowcount)


async def acquire_lock(session: AsyncSession, key: str, owner: str, job: str, ttl_s: float) -> bool:
    """Take the lock `key` for a `job`, or an expired one; False when a live job holds it. Commits."""
    now = datetime.now(UTC)
    expires = now + timedelta(seconds=ttl_s)
    inserted = await session.execute(
        insert(session, JobLock)
        .values(key=key, owner=owner, job=job, acquired_at=now, expires_at=expires)
        .on_conflict_do_nothing()
    )
    taken = _rowcount(inserted) == 1
    if not taken:
        # A job that stopped renewing its lock (crash, kill -9) is presumed dead.
        stale = await session.execute(
            update(JobLock)
            .where(JobLock.key == key, JobLock.expires_at < now)
            .values(owner=owner, job=job, acquired_at=now, expires_at=expires)
        )
        taken = _rowcount(stale) == 1
        if taken:
            logger.warning("took over the expired job lock %s", key)
    await session.commit()
    return taken


async def renew_lock(session: AsyncSession, key: str, owner: str, ttl_s: float) -> bool:
    """Push the expiry forward; False if this owner no longer holds the lock. Commits."""
    result = await session.execute(
        update(JobLock)
        .where(JobLock.key == key, JobLock.owner == owner)
        .values(expires_at=datetime.now(UTC) + timedelta(seconds=ttl_s))
    )
    await session.commit()
    return _rowcount(result) == 1


async def release_lock(session: AsyncSession, key: str, owner: str) -> None:
    await session.execute(delete(JobLock).where(JobLock.key == key, JobLock.owner == owner))
    await session.commit()


@contextlib.asynccontextmanager
async def heartbeat(
    database: Database, key: str, owner: str, ttl_s: float, on_lost: Callable[[], None] | None = None
) -> AsyncIterator[None]:
    """Renew the lock every ttl/3 while the body runs; calls `on_lost` once if it was taken over.

    A failed renewal (the database away for a moment) is retried at the next beat: the lock only expires
    after a whole ttl without one.
    """

    async def beat() -> None:
        while True:
            await asyncio.sleep(ttl_s / 3)
            try:
                async with database.session() as session:
                    held = await renew_lock(session, key, owner, ttl_s)
            except Exception as exc:
                logger.warning("could not renew the job lock %s: %s", key, exc)
                continue
            if not held:
                logger.error("lost the job lock %s", key)
                if on_lost is not None:
                    on_lost()
                return

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
