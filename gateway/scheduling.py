"""The scheduler in a gateway or worker process: the job runner built from the settings, and its lifecycle.

`kaizen serve` runs the schedules itself unless `KAIZEN_SCHEDULER=false`; `kaizen worker` runs only them.
The admin API starts jobs through the same runner, so a manual run obeys the same one-job-per-policy lock.
"""

from __future__ import annotations

import functools
import logging
import sys

from gateway.base_models import resolve_base_model
from gateway.housekeeping import Housekeeping
from gateway.settings import Settings
from storage.database import Database
from trainer.control.launch import torchrun_command
from trainer.control.scheduler import JobRunner, PolicyScheduler, RunnerConfig

log = logging.getLogger(__name__)


def gate_url(settings: Settings) -> str:
    if settings.gate_url:
        return settings.gate_url
    host = "127.0.0.1" if settings.host in ("", "0.0.0.0", "::") else settings.host
    return f"http://{host}:{settings.port}/v1"


def train_command(settings: Settings) -> list[str]:
    """argv of the training child (`python -m trainer.learner`), through torchrun when a run uses several
    processes (`KAIZEN_TRAIN_PROCESSES`). Everything else, secrets included, goes to it as its `TrainingJob`."""
    if settings.train_processes > 1:
        return torchrun_command(sys.executable, settings.train_processes)
    return [sys.executable, "-m", "trainer.learner"]


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
        database_url=settings.database_url,
        judge=settings.judge(),
        train_command=train_command(settings),
        base_model_path=functools.partial(resolve_base_model, models_dir=settings.data_dir / "models"),
        gate_url=gate_url(settings),
        gate_api_key=settings.api_keys[0] if settings.api_keys else None,
        admin_api_key=settings.admin_key or None,
        webhook_secret=settings.feedback_secret,
        # A sleeping engine cannot answer the trainer: it then samples with its own copy of the adapter.
        resample_through_gateway=settings.train_sampler == "engine"
        and not settings.engine_sleep_during_training,
        max_n=settings.max_n,
        engine_url=engine_url,
        sleep_engine=settings.engine_sleep_during_training,
        train_gpus=settings.train_gpus,
        train_threads=settings.training_threads(),
        train_timeout_s=settings.train_timeout_s,
        retention_calls_days=settings.retention_calls_days,
        log_level=settings.log_level,
    )


class Jobs:
    """The runner (always: the admin API triggers runs) and, when enabled, the policies' schedules and the
    storage upkeep no policy owns (`gateway.housekeeping`)."""

    def __init__(
        self, settings: Settings, database: Database, *, schedule: bool, engine_url: str | None = None
    ) -> None:
        self.runner = JobRunner(database, runner_config(settings, engine_url))
        self.scheduler: PolicyScheduler | None = None
        self.housekeeping: Housekeeping | None = None
        if schedule:
            self.scheduler = PolicyScheduler(
                database, self.runner, settings.scheduler_refresh_s, settings.rollout_check_s
            )
            self.housekeeping = Housekeeping(
                database, settings.retention_calls_days, settings.retention_cron or None
            )

    async def start(self) -> None:
        if self.scheduler is not None and self.housekeeping is not None:
            await self.scheduler.start()
            await self.housekeeping.start()

    async def sync(self) -> None:
        """Apply a schedule change made through this process at once (others see it on their next refresh)."""
        if self.scheduler is not None:
            await self.scheduler.sync()

    async def stop(self) -> None:
        if self.housekeeping is not None:
            await self.housekeeping.stop()
        if self.scheduler is not None:
            await self.scheduler.stop()
        else:
            await self.runner.close()
