"""Typed schedule of a policy, stored as ``policies.config["schedule"]``; every field has a default.

The defaults close the loop without anyone watching: judge new traffic hourly, train nightly (and earlier when
enough newly rewarded episodes arrived, if a threshold is set), and prune old calls and unused versions daily.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator


def parse_cron(expression: str) -> Any:
    """An APScheduler trigger for a 5-field crontab line, in UTC (raises ValueError when malformed)."""
    from apscheduler.triggers.cron import CronTrigger

    return CronTrigger.from_crontab(expression, timezone="UTC")


class RetentionConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cron: str | None = Field("30 4 * * *", description="When retention runs (crontab, UTC); null: never.")
    calls_days: float | None = Field(
        90, gt=0, description="Delete calls (and their episodes and rewards) older than this; null: keep."
    )
    keep_versions: int = Field(
        5, ge=1, description="Keep the newest this many versions; the active and pinned ones are always kept."
    )

    @field_validator("cron")
    @classmethod
    def _valid_cron(cls, value: str | None) -> str | None:
        if value is not None:
            parse_cron(value)
        return value


class ScheduleConfig(BaseModel):
    """When the scheduler runs a policy's jobs. One job of a policy runs at a time, in any process."""

    model_config = ConfigDict(extra="forbid")

    paused: bool = Field(False, description="No scheduled job of this policy runs (manual runs still do).")
    judge_interval_s: float | None = Field(
        3600.0, gt=0, description="Score unscored groups this often; null: never on a schedule."
    )
    train_cron: str | None = Field(
        "0 3 * * *", description="Train at these times (crontab, UTC; default nightly); null: no cron."
    )
    train_min_new_episodes: int | None = Field(
        None,
        ge=1,
        description="Also train as soon as this many episodes were rewarded since the last run; null: off.",
    )
    threshold_check_s: float = Field(
        300.0, gt=0, description="How often the new-episode threshold is checked."
    )
    misfire_grace_s: float = Field(
        3600.0,
        gt=0,
        description="A run that could not start on time still runs this late (once, however many were missed).",
    )
    retention: RetentionConfig = Field(default_factory=RetentionConfig)  # type: ignore[arg-type]

    @field_validator("train_cron")
    @classmethod
    def _valid_cron(cls, value: str | None) -> str | None:
        if value is not None:
            parse_cron(value)
        return value

    @classmethod
    def from_policy_config(cls, config: dict[str, Any]) -> ScheduleConfig:
        return cls.model_validate(dict(config.get("schedule") or {}))
