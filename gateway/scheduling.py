"""The scheduler in a gateway or worker process: the job runner built from the settings, and its lifecycle.

`kaizen serve` runs the schedules itself unless `KAIZEN_SCHEDULER=false`; `kaizen worker` runs only them.
The admin API starts jobs through the same runner, so a manual run obeys the same one-job-per-policy lock.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from pathlib import Path

from gateway.base_models import resolve_base_model
from gateway.commands.judge import judge_settings
from gateway.settings import Settings
from storage.database import Database
from trainer.control.launch import torchrun_command
from trainer.control.scheduler import JobRunner, PolicyScheduler, RunnerConfig

log = logging.getLogger(__name__)


def child_env(settings: Settings) -> dict[str, str]:
    """The parent's settings as `KAIZEN_*` variables, so the training child sees exactly the same ones."""
    env = dict(os.environ)
    for name in Settings.model_fields:
        value = getattr(settings, name)
        if isinstance(value, list):
            text = ",".join(str(v) for v in value)
        elif isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, Path):
            text = str(value.resolve())
        else:
            text = str(value)
        env[f"KAIZEN_{name.upper()}"] = text
    return env


def gate_url(settings: Settings) -> str:
    if settings.gate_url:
        return settings.gate_url
    host = "127.0.0.1" if settings.host in ("", "0.0.0.0", "::") else settings.host
    return f"http://{host}:{settings.port}/v1"


def train_command(settings: Settings) -> list[str]:
    """argv of the training child (`python -m trainer.learner`, the scheduler adds `--policy` and `--base-model`), through
    torchrun when a run uses several processes (`KAIZEN_TRAIN_PROCESSES`).

    Secrets stay out of argv: the child reads them from its environment (`child_env`)."""
    argv = [
        "--data-dir",
        str(settings.data_dir.resolve()),
        "--log-level",
        settings.log_level,
        *judge_arguments(settings),
    ]
    if settings.train_sampler == "engine" and not settings.engine_sleep_during_training:
        argv += ["--engine-url", gate_url(settings), "--engine-max-n", str(settings.max_n)]
    if settings.train_processes > 1:
        return torchrun_command(sys.executable, settings.train_processes, argv)
    return [sys.executable, "-m", "trainer.learner", *argv]


def judge_arguments(settings: Settings) -> list[str]:
    """The judge settings as `python -m trainer.learner` flags (the API key goes by environment)."""
    judge = judge_settings(settings)
    argv = [
        "--judge-model",
        judge.model,
        "--judge-temperature",
        str(judge.temperature),
        "--judge-timeout-s",
        str(judge.timeout_s),
        "--judge-max-retries",
        str(judge.max_retries),
        "--judge-concurrency",
        str(judge.concurrency),
    ]
    return [*argv, "--judge-api-base", judge.api_base] if judge.api_base else argv


def runner_config(settings: Settings, engine_url: str | None = None) -> RunnerConfig:
    """`engine_url`: the /v1 URL of this process's vLLM engine. A separate worker has no engine: it uses
    `vllm_url`, or the configured `vllm_port` (with port 0 it cannot know the gateway's pick)."""
    if engine_url is None and settings.engine == "vllm":
        if len(settings.vllm_urls) == 1:
            engine_url = settings.vllm_urls[0]
        elif settings.vllm_port and settings.vllm_replicas == 1:
            engine_url = f"http://127.0.0.1:{settings.vllm_port}/v1"
    return RunnerConfig(
        data_dir=settings.data_dir,
        judge=judge_settings(settings),
        train_command=train_command(settings),
        base_model_path=functools.partial(resolve_base_model, models_dir=settings.data_dir / "models"),
        child_env=child_env(settings),
        gate_url=gate_url(settings),
        gate_api_key=settings.api_keys[0] if settings.api_keys else None,
        webhook_secret=settings.feedback_secret,
        engine_url=engine_url,
        sleep_engine=settings.engine_sleep_during_training,
        train_timeout_s=settings.train_timeout_s,
        retention_calls_days=settings.retention_calls_days,
        retention_cron=settings.retention_cron or None,
    )


class Jobs:
    """The runner (always: the admin API triggers runs) and, when enabled, the schedules."""

    def __init__(
        self, settings: Settings, database: Database, *, schedule: bool, engine_url: str | None = None
    ) -> None:
        self.runner = JobRunner(database, runner_config(settings, engine_url))
        self.scheduler = (
            PolicyScheduler(database, self.runner, settings.scheduler_refresh_s) if schedule else None
        )

    async def start(self) -> None:
        if self.scheduler is None:
            return
        try:
            await self.scheduler.start()
        except ImportError:
            # APScheduler is a dependency of kaizen itself: only a broken install gets here.
            log.error(
                "APScheduler is not installed (reinstall kaizen with its dependencies); schedules are off"
            )
            self.scheduler = None

    async def sync(self) -> None:
        """Apply a schedule change made through this process at once (others see it on their next refresh)."""
        if self.scheduler is not None:
            await self.scheduler.sync()

    async def stop(self) -> None:
        if self.scheduler is not None:
            await self.scheduler.stop()
        else:
            await self.runner.close()
