"""The scheduler's catch-up arithmetic after a restart and retention's choice of versions."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from storage.policies import AdapterInfo
from storage.retention import versions_to_keep
from trainer.control.policy_config import ScheduleConfig
from trainer.control.scheduler import catch_up_time, missed_fire_time, previous_fire_time, schedule_slot

NOW = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)


def test_interval_catch_up_runs_once_now_after_downtime() -> None:
    assert catch_up_time(None, NOW, 60) == NOW + timedelta(seconds=60)  # never ran: one interval from now
    assert catch_up_time(NOW - timedelta(seconds=20), NOW, 60) == NOW + timedelta(seconds=40)
    assert catch_up_time(NOW - timedelta(seconds=600), NOW, 60) == NOW  # ten missed: one run, now


def test_cron_missed_only_when_a_fire_time_passed_since_the_last_run() -> None:
    nightly = "0 3 * * *"
    # The first firing after the last run: what a catch-up run stands for.
    assert missed_fire_time(nightly, NOW - timedelta(days=3), NOW) == NOW.replace(hour=3) - timedelta(days=2)
    assert missed_fire_time(nightly, NOW.replace(hour=3, minute=0), NOW) is None  # ran at 03:00 today
    assert missed_fire_time(nightly, None, NOW) is None


def test_a_firing_is_one_slot_for_every_replica() -> None:
    every_minute, nightly = "* * * * *", "0 3 * * *"
    late = NOW + timedelta(seconds=42)
    assert previous_fire_time(every_minute, late, 3600) == NOW
    assert previous_fire_time(every_minute, NOW, 3600) == NOW  # a firing at exactly now is its own slot
    assert previous_fire_time(nightly, NOW, 3600) is None  # 03:00 is beyond the look-back
    assert previous_fire_time(nightly, NOW, 10 * 3600) == NOW.replace(hour=3)
    config = ScheduleConfig(judge_interval_s=600, train_cron=every_minute)
    assert schedule_slot(config, "judge", "interval", late) == late - timedelta(seconds=300)
    assert schedule_slot(config, "train", "cron", late) == NOW
    assert schedule_slot(config, "train", "threshold", late) is None  # re-counted, not a slot
    assert schedule_slot(config, "judge", "manual", late) is None


def _adapter(version: int, status: str, pinned: bool = False) -> AdapterInfo:
    return AdapterInfo(1, version, status, f"/a/{version}", None, pinned, {}, NOW)


def test_retention_keeps_active_pinned_newest_and_rollback_target() -> None:
    adapters = [
        _adapter(0, "retired"),
        _adapter(1, "retired", pinned=True),
        _adapter(2, "retired"),
        _adapter(3, "active"),
        _adapter(4, "rejected"),
        _adapter(5, "retired"),
        _adapter(6, "candidate"),
        _adapter(7, "candidate"),
    ]
    assert versions_to_keep(adapters, 3, keep=2) == {1, 2, 3, 6, 7}
