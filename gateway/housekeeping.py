"""Storage upkeep that belongs to no policy, run by every process that runs schedules (`kaizen serve`, `kaizen
worker`): the dashboard's rollups, PostgreSQL's day partitions of `calls` kept ahead of the clock, and the
retention of calls no policy owns (traffic in front of an upstream model).

Each job is safe on several replicas at once: the rollup refresh and the partition creation are idempotent, and
the retention takes a lock for its firing, so one replica runs it.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from typing import Any

from storage.database import Database
from storage.locks import acquire_lock, lock_owner
from storage.partitions import ensure_partitions
from storage.retention import checkpoint_wal, prune_calls
from storage.rollups import REFRESH_INTERVAL_S, refresh_if_stale
from trainer.control.policy_config import parse_cron
from trainer.control.scheduler import drop_expired_days

log = logging.getLogger(__name__)

#: The lock of the retention of calls no policy owns ('/' cannot be in a policy's name).
UNOWNED_RETENTION_LOCK = "/retention"
#: How often the coming days' partitions are checked (a long-running process never re-runs its start's).
PARTITIONS_INTERVAL_S = 6 * 3600.0


def _now() -> datetime:
    return datetime.now(UTC)


class Housekeeping:
    """The upkeep jobs on an APScheduler of their own, beside the policies' `PolicyScheduler`."""

    def __init__(self, database: Database, retention_calls_days: float, retention_cron: str | None) -> None:
        """`retention_calls_days`: age after which calls no policy owns are deleted (0: kept);
        `retention_cron`: when (None: never)."""
        self.database = database
        self.retention_calls_days = retention_calls_days
        self.retention_cron = retention_cron
        self._scheduler: Any = None

    async def start(self) -> None:
        from apscheduler.schedulers.asyncio import AsyncIOScheduler

        self._scheduler = AsyncIOScheduler(
            timezone=UTC, job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": 3600}
        )
        self._scheduler.start()
        self._scheduler.add_job(
            self.roll_up, "interval", seconds=REFRESH_INTERVAL_S, id="kaizen:rollups", next_run_time=_now()
        )
        self._scheduler.add_job(
            self.create_partitions,
            "interval",
            seconds=PARTITIONS_INTERVAL_S,
            id="kaizen:partitions",
            next_run_time=_now(),
        )
        if self.retention_cron:
            self._scheduler.add_job(
                self.scheduled_prune, parse_cron(self.retention_cron), id="kaizen:retention"
            )

    async def stop(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=False)
            self._scheduler = None

    async def roll_up(self) -> None:
        """Keep the dashboard's rollup current (one replica at a time; the others find it busy or fresh)."""
        try:
            # Half the interval: a run a moment early must not find the last one just fresh enough.
            await refresh_if_stale(self.database, REFRESH_INTERVAL_S / 2)
        except Exception:
            log.exception("could not refresh the dashboard's rollups")

    async def create_partitions(self) -> None:
        """PostgreSQL: keep the day partitions of `calls` ready ahead of the clock. Idempotent."""
        try:
            async with self.database.engine.connect() as connection:
                await ensure_partitions(connection, _now().date())
                await connection.commit()
        except Exception:
            log.exception("could not create the coming days' call partitions")

    async def prune_unowned_calls(self) -> tuple[int, int]:
        """Delete calls no policy row owns older than `retention_calls_days`, whole day partitions first.

        Returns (calls, episodes) deleted. Idempotent, so replicas running it at once do no harm.
        """
        if self.retention_calls_days <= 0:
            return 0, 0
        days = await drop_expired_days(self.database, self.retention_calls_days)
        cutoff = _now() - timedelta(days=self.retention_calls_days)
        async with self.database.session() as session:
            calls, episodes = await prune_calls(session, None, cutoff)
            await session.commit()
        calls, episodes = calls + days.calls, episodes + days.episodes
        async with self.database.session() as session:
            await checkpoint_wal(session)
        log.info("retention of calls no policy owns: %d calls, %d episodes deleted", calls, episodes)
        return calls, episodes

    async def scheduled_prune(self) -> None:
        """`prune_unowned_calls` on its cron, once per firing across every replica: the first to fire takes a
        lock that it keeps until the next firing, so the others skip this one. A failure is logged, the next
        firing retries."""
        assert self.retention_cron is not None
        now = _now()
        following = parse_cron(self.retention_cron).get_next_fire_time(None, now + timedelta(seconds=1))
        hold_s = max((following - now).total_seconds() - 1.0, 1.0) if following is not None else 3600.0
        try:
            async with self.database.session() as session:
                if not await acquire_lock(session, UNOWNED_RETENTION_LOCK, lock_owner(), "retention", hold_s):
                    log.info("retention of calls no policy owns ran elsewhere for this firing")
                    return
            await self.prune_unowned_calls()
        except Exception:
            log.exception("retention of calls no policy owns failed")
