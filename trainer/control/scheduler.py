"""Scheduled jobs per policy (judge, train, retention) and the runner that executes one job at a time.

The runner is shared by the APScheduler jobs, the admin API and `kaizen worker --once`. Whatever starts a
job, the database lock on the policy's name lets exactly one run at a time across processes and replicas;
a job that finds the lock taken is skipped. Training runs in a child process (`kaizen train`), so the
gateway keeps serving and a crash of the child only marks its run failed. A candidate the child wrote goes
through the evaluation gate and is promoted only if it passes.

A restarted scheduler reads when each job last ran from `training_runs`: a run missed while nothing was up
runs once at start (coalesced), however many intervals were missed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import json
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

import httpx
from sqlalchemy.ext.asyncio import AsyncSession

from storage.database import Database
from storage.jobs import (
    RunInfo,
    count_rewarded_episodes,
    get_run,
    last_run_at,
    latest_run_id,
    set_adapter_status,
    start_job_run,
    update_run,
)
from storage.locks import heartbeat, lock_owner, release_lock
from storage.models import DEFAULT_PROJECT
from storage.partitions import DroppedDays, drop_expired_partitions
from storage.policies import PolicyInfo, get_policy, list_policies, promote
from storage.retention import checkpoint_wal, prune_adapters, prune_calls
from storage.rollouts import RolloutInfo, end_rollout, running_rollout, start_rollout
from storage.training import last_data_cutoff, take_policy_lock
from trainer.control.canary import ACTOR, watch
from trainer.control.child_processes import PARENT_DEATH_SIGNAL, dying_with_parent, stop_group
from trainer.control.gate import GateResult, VersionSampler, evaluate
from trainer.control.judge_job import judge_policy
from trainer.control.policy_config import InvalidPolicyConfig, ScheduleConfig, load_policy_config, parse_cron
from trainer.control.ruler import JudgeSettings
from trainer.control.run_logs import RunLog
from trainer.control.scoring import Scorer
from trainer.control.shadow_scoring import score_shadow_pairs
from trainer.control.tools import ToolBox
from trainer.control.training_job import TrainingJob, exit_error

logger = logging.getLogger(__name__)

JobKind = Literal["judge", "train", "retention"]
#: vLLM's sleep-mode endpoints around a training child: level 1 moves the weights to host memory and drops the
#: KV cache; `mode=wait` drains the calls in flight and queues new ones until the wake.
ENGINE_SLEEP_PATH = "/sleep?level=1&mode=wait"
ENGINE_WAKE_PATH = "/wake_up"
JOB_KINDS: tuple[JobKind, ...] = ("judge", "train", "retention")


class OwnerUnreachable(RuntimeError):
    """The gate and resampling have no key that an owned policy answers."""


class JobBusy(RuntimeError):
    """Another job of the policy holds its lock (in this process or another)."""


class JobAlreadyRan(JobBusy):
    """A run of this job started in the same slot of its schedule already (another replica's scheduler)."""


@dataclass(frozen=True)
class TrainOptions:
    """One training run's own choices on top of the policy's `train` configuration (the admin API's train
    body, `kaizen train`'s flags): `TrainConfig` overrides, where its data window starts, and its device."""

    overrides: Mapping[str, Any] = field(default_factory=dict)
    since: datetime | None = None
    device: str | None = None


@dataclass(frozen=True)
class RunnerConfig:
    """What jobs need from the process settings (built by the gateway; the trainer never reads settings)."""

    data_dir: Path
    database_url: str
    judge: JudgeSettings
    #: argv of the training child: `python -m trainer.learner`, or torchrun around it (`trainer.control.launch`).
    #: Its `TrainingJob` goes on its stdin.
    train_command: Sequence[str]
    #: OpenAI-compatible URL the gate samples both versions through (the gateway's own /v1).
    gate_url: str
    #: The key the gate, and the training child's resampling, present to the gateway.
    gate_api_key: str | None = None
    #: The admin key: what they present instead for a policy owned by a project other than the built-in one,
    #: which refuses the environment's keys (`gateway_key`).
    admin_api_key: str | None = None
    webhook_secret: str = ""
    #: `resample` grouping samples through the gateway at `gate_url` (vLLM's exact token ids and behaviour
    #: logprobs); off: with the trainer's own copy of the adapter.
    resample_through_gateway: bool = True
    #: The gateway's largest `n` per call.
    max_n: int = 16
    #: The engine's own /v1 URL: put to sleep during training when `sleep_engine` (vLLM on a GPU only).
    engine_url: str | None = None
    sleep_engine: bool = False
    #: `CUDA_VISIBLE_DEVICES` of the training child (a GPU apart from the engine's); empty: it inherits ours.
    train_gpus: str = ""
    #: `OMP_NUM_THREADS` of the training child (CPU threads; fewer than the cores leaves some to vLLM); 0: ours.
    train_threads: int = 0
    train_timeout_s: float = 6 * 3600.0
    #: What a training child gets after SIGTERM to record its run and stop (torchrun stops its ranks) before
    #: its process group, whatever is left of it, is killed.
    stop_grace_s: float = 20.0
    lock_ttl_s: float = 60.0
    #: Age after which calls no policy row owns are deleted (0: kept): a day partition holding one of them is
    #: dropped by a policy's retention only past it.
    retention_calls_days: float = 90.0
    #: Maps a policy's base model to what the child loads (a local directory, or a Hugging Face id passed
    #: through); runs in a thread, as it may build an embedded model on first use.
    base_model_path: Callable[[str], str] = str
    log_level: str = "info"

    def train_environment(self) -> dict[str, str] | None:
        """The training child's environment: ours, with the GPUs and CPU threads it is given (None: ours)."""
        placement = {}
        if self.train_gpus:
            placement["CUDA_VISIBLE_DEVICES"] = self.train_gpus
        if self.train_threads:
            placement["OMP_NUM_THREADS"] = str(self.train_threads)
        return {**os.environ, **placement} if placement else None

    def gateway_key(self, project: str | None) -> str | None:
        """The key the gate and resampling present for a policy owned by `project` (None: shared). An owned
        policy answers only its project's keys and admin keys; the environment's keys are the built-in
        project's, so another owner's policy is sampled with the admin key. Without one, every call would be
        its 404, which the sampler waits out as a restarting engine's: refuse at once instead."""
        if project is None or project == DEFAULT_PROJECT:
            return self.gate_api_key
        if not self.admin_api_key:
            raise OwnerUnreachable(
                f"the policy is owned by project {project!r}, whose policies answer only that project's keys "
                "and admin keys: set KAIZEN_ADMIN_KEY so that the gate and resampling can call it"
            )
        return self.admin_api_key

    def training_job(
        self,
        policy: str,
        base_model: str,
        options: TrainOptions,
        lock_owner: str | None = None,
        project: str | None = None,
    ) -> TrainingJob:
        """The job a training child of `policy` (owned by `project`; None: shared) runs; `base_model` is already
        resolved (`base_model_path`)."""
        return TrainingJob(
            policy=policy,
            database_url=self.database_url,
            data_dir=str(self.data_dir.resolve()),
            base_model=base_model,
            judge=self.judge,
            webhook_secret=self.webhook_secret,
            engine_url=self.gate_url if self.resample_through_gateway else None,
            engine_api_key=self.gateway_key(project) if self.resample_through_gateway else None,
            engine_max_n=self.max_n,
            overrides=dict(options.overrides),
            since=options.since,
            device=options.device,
            lock_owner=lock_owner,
            log_level=self.log_level,
        )


def _now() -> datetime:
    return datetime.now(UTC)


class JobRunner:
    """Runs one job of one policy under the policy's database lock and records it in `training_runs`."""

    def __init__(self, database: Database, config: RunnerConfig) -> None:
        self.database = database
        self.config = config
        self._tasks: set[asyncio.Task[Any]] = set()

    async def start(
        self, policy: str, kind: JobKind, trigger: str = "manual", options: TrainOptions | None = None
    ) -> int:
        """Start a job in the background and return its run id once it has one; raises JobBusy or LookupError.

        `options` only apply to a train job."""
        announced: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        task = self._track(self._execute(policy, kind, trigger, announced, None, options))
        task.add_done_callback(lambda t: _forward_failure(t, announced))
        return await asyncio.shield(announced)

    async def run(
        self, policy: str, kind: JobKind, trigger: str = "manual", slot_start: datetime | None = None
    ) -> RunInfo | None:
        """Run a job to its end; None when another job of the policy holds the lock, when `slot_start` is given
        and a run of this kind started at or after it (the slot's run happened elsewhere already), or when
        `close` interrupted it."""
        announced: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        # A task of the runner's own, so that `close` ends a scheduled job too, while the engine and the
        # database are still up (the loop's teardown would cancel it only after they are gone).
        task = self._track(self._execute(policy, kind, trigger, announced, slot_start))
        try:
            run_id = await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # this caller was cancelled (and the job with it)
            logger.info("%s job of %s interrupted: the scheduler is stopping", kind, policy)
            return None
        except JobAlreadyRan:
            logger.info("%s job of %s skipped: it ran in this slot of its schedule already", kind, policy)
            return None
        except JobBusy:
            logger.info("%s job of %s skipped: another job of the policy is running", kind, policy)
            return None
        async with self.database.session() as session:
            return await get_run(session, run_id)

    def _track(self, job: Coroutine[Any, Any, int]) -> asyncio.Task[int]:
        """Run a job as a task that `close` cancels."""
        task = asyncio.create_task(job)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        """Cancel running jobs (a training child is killed and its run marked failed)."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task

    # ------------------------------------------------------------------ one job
    async def _execute(
        self,
        name: str,
        kind: JobKind,
        trigger: str,
        announced: asyncio.Future[int],
        slot_start: datetime | None,
        options: TrainOptions | None = None,
    ) -> int:
        def announce(run_id: int) -> None:
            if not announced.done():
                announced.set_result(run_id)

        async with self.database.session() as session:
            policy = await get_policy(session, name)
        if policy is None:
            raise LookupError(f"no policy named {name!r}")
        owner = lock_owner()
        ttl = self.config.lock_ttl_s
        async with self.database.session() as session:
            if not await take_policy_lock(session, policy, owner, kind, ttl):
                raise JobBusy(f"a job of policy {name!r} is already running")
        try:
            if slot_start is not None:
                # Under the lock, so no other replica's run of this slot can start meanwhile.
                async with self.database.session() as session:
                    last = await last_run_at(session, policy.id, kind)
                if last is not None and last >= slot_start:
                    raise JobAlreadyRan(f"the {kind} job of {name!r} ran at {last.isoformat()}")
            jobs: dict[str, Callable[[PolicyInfo, str, Callable[[int], None]], Awaitable[int]]] = {
                "judge": self._judge,
                "train": functools.partial(self._train, owner=owner, options=options or TrainOptions()),
                "retention": self._retention,
            }
            async with heartbeat(self.database, name, owner, ttl):
                return await jobs[kind](policy, trigger, announce)
        finally:
            async with self.database.session() as session:
                await release_lock(session, name, owner)

    async def _new_run(self, policy: PolicyInfo, kind: str, trigger: str) -> int:
        async with self.database.session() as session:
            run_id = await start_job_run(
                session, policy.id, kind, policy.active_version, {"trigger": trigger}
            )
            await session.commit()
        return run_id

    async def _finish(self, run_id: int, status: str, **values: Any) -> None:
        async with self.database.session() as session:
            await update_run(session, run_id, status=status, finished_at=_now(), **values)
            await session.commit()

    async def _judge(self, policy: PolicyInfo, trigger: str, announce: Callable[[int], None]) -> int:
        run_id = await self._new_run(policy, "judge", trigger)
        announce(run_id)
        try:
            # A scheduled run leaves episodes an agent may still be adding turns to; a manual one was asked for now.
            quiet_s = 0.0 if trigger == "manual" else load_policy_config(policy.config).schedule.judge_quiet_s
            report = await judge_policy(
                self.database,
                policy.name,
                self.config.judge,
                webhook_secret=self.config.webhook_secret,
                settled_before=_now() - timedelta(seconds=quiet_s) if quiet_s else None,
            )
        except Exception as exc:
            logger.exception("judge job of %s failed", policy.name)
            await self._finish(run_id, "failed", error=repr(exc)[:4000])
            return run_id
        failed = report.failed > 0 and report.judged == 0
        await self._finish(
            run_id,
            "failed" if failed else "succeeded",
            metrics=dataclasses.asdict(report),
            error="every group failed to score" if failed else None,
        )
        return run_id

    async def _retention(self, policy: PolicyInfo, trigger: str, announce: Callable[[int], None]) -> int:
        run_id = await self._new_run(policy, "retention", trigger)
        announce(run_id)
        try:
            config = load_policy_config(policy.config).schedule.retention
            days = await drop_expired_days(self.database, self.config.retention_calls_days)
            calls = episodes = 0
            async with self.database.session() as session:
                fresh = await get_policy(session, policy.name)
                active = fresh.active_version if fresh is not None else None
                if config.calls_days is not None:
                    cutoff = _now() - timedelta(days=config.calls_days)
                    calls, episodes = await prune_calls(session, policy.name, cutoff)
                pruned = await prune_adapters(session, policy.id, active, config.keep_versions)
                await session.commit()
            async with self.database.session() as session:
                await checkpoint_wal(session)
            await asyncio.to_thread(_remove_dirs, self.config.data_dir / "adapters", [a.path for a in pruned])
        except Exception as exc:
            logger.exception("retention job of %s failed", policy.name)
            await self._finish(run_id, "failed", error=repr(exc)[:4000])
            return run_id
        metrics = {
            "calls": calls,
            "episodes": episodes,
            "versions": [a.version for a in pruned],
            # Whole days dropped on the way, whoever's calls they held (each past its own owner's retention).
            "dropped_days": days.partitions,
            "dropped_day_calls": days.calls,
            "dropped_day_episodes": days.episodes,
        }
        logger.info("retention of %s: %s", policy.name, metrics)
        await self._finish(run_id, "succeeded", metrics=metrics)
        return run_id

    # ------------------------------------------------------------------ training
    async def _train(
        self,
        policy: PolicyInfo,
        trigger: str,
        announce: Callable[[int], None],
        *,
        owner: str,
        options: TrainOptions,
    ) -> int:
        async with self.database.session() as session:
            before = await latest_run_id(session, policy.id, "train")
        with RunLog(self.config.data_dir, policy.name) as log:
            await self._engine_sleep(True)
            try:
                rc, tail, run_id = await self._run_child(policy, owner, before, announce, log, options)
            finally:
                await self._engine_sleep(False)
            error = exit_error(rc, "".join(tail).strip()[-4000:])
            if run_id is None:  # it died before recording a run (bad config, missing model, crash at import)
                run_id = await self._new_run(policy, "train", trigger)
                log.attach(run_id)
                announce(run_id)
                await self._finish(run_id, "failed", error=error, metrics={"exit_code": rc})
                logger.error("training of %s failed before it started (exit %s)", policy.name, rc)
                return run_id
        async with self.database.session() as session:
            await update_run(session, run_id, config=await self._run_config(run_id, trigger))
            await session.commit()
            run = await get_run(session, run_id)
        assert run is not None
        if run.status == "running":  # killed before it could record its outcome (OOM, signal)
            await self._finish(run_id, "failed", error=error, metrics={**run.metrics, "exit_code": rc})
            return run_id
        if run.status == "succeeded" and run.to_version is not None:
            await self.gate(policy.name, run.id)
        return run_id

    async def _run_config(self, run_id: int, trigger: str) -> dict[str, Any]:
        async with self.database.session() as session:
            run = await get_run(session, run_id)
        return {**(run.config if run is not None else {}), "trigger": trigger}

    async def _run_child(
        self,
        policy: PolicyInfo,
        owner: str,
        before: int,
        announce: Callable[[int], None],
        log: RunLog,
        options: TrainOptions,
    ) -> tuple[int | None, collections.deque[str], int | None]:
        try:
            base_model = await asyncio.to_thread(self.config.base_model_path, policy.base_model)
        except Exception as exc:  # recorded as a run that failed before it started, like a child dying early
            problem = f"base model {policy.base_model!r}: {exc!r}\n"
            log.write(problem)
            return None, collections.deque([problem]), None
        try:
            job = self.config.training_job(
                policy.name, base_model, options, lock_owner=owner, project=policy.project
            )
        except OwnerUnreachable as exc:
            log.write(f"{exc}\n")
            return None, collections.deque([f"{exc}\n"]), None
        argv = list(self.config.train_command)
        logger.info("training %s in a child process: %s", policy.name, " ".join(argv))
        # A group of its own (stopping it reaches torchrun's ranks too), yet signalled when this process dies, even
        # by SIGKILL: an orphan would go on training under the lock it inherited, and no run could start until
        # it ended. The signal is one of its own, so its run records that its parent died.
        process = await asyncio.create_subprocess_exec(
            *dying_with_parent(argv, PARENT_DEATH_SIGNAL),
            env=self.config.train_environment(),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        assert process.stdin is not None
        with contextlib.suppress(ConnectionError):  # a child that died at once: its exit status tells
            process.stdin.write(job.encode())
            await process.stdin.drain()
        process.stdin.close()
        tail: collections.deque[str] = collections.deque(maxlen=40)

        async def pump() -> None:
            assert process.stdout is not None
            async for raw in process.stdout:
                line = raw.decode(errors="replace")
                log.write(line)
                tail.append(line)

        reader = asyncio.create_task(pump())
        run_id: int | None = None
        deadline = time.monotonic() + self.config.train_timeout_s
        try:
            while process.returncode is None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(process.wait()), 0.5)
                if run_id is None:
                    run_id = await self._child_run(policy.id, before)
                    if run_id is not None:
                        log.attach(run_id)
                        announce(run_id)
                if time.monotonic() > deadline and process.returncode is None:
                    await stop_group(process, self.config.stop_grace_s)
                    tail.append(f"training exceeded {self.config.train_timeout_s:.0f} s and was stopped\n")
        except BaseException:
            if process.returncode is None:  # the gateway is shutting down: the run is lost, not left running
                await stop_group(process, self.config.stop_grace_s)
                found = run_id or await self._child_run(policy.id, before)
                if found is not None:
                    log.attach(found)
                    await self._finish(found, "failed", error="interrupted: the scheduler shut down")
            raise
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(reader, 10)
        if run_id is None:
            run_id = await self._child_run(policy.id, before)
            if run_id is not None:
                log.attach(run_id)
        return process.returncode, tail, run_id

    async def _child_run(self, policy_id: int, before: int) -> int | None:
        async with self.database.session() as session:
            latest = await latest_run_id(session, policy_id, "train")
        return latest if latest > before else None

    async def _engine_sleep(self, asleep: bool) -> None:
        """Free the GPU for training (vLLM's /sleep, /wake_up: GPU builds with VLLM_SERVER_DEV_MODE=1).

        Without `mode=wait` vLLM aborts the calls it is answering (its default, `abort`); versions that predate
        the parameter ignore it."""
        if not self.config.sleep_engine or not self.config.engine_url:
            return
        root = self.config.engine_url.rstrip("/").removesuffix("/v1")
        path = ENGINE_SLEEP_PATH if asleep else ENGINE_WAKE_PATH
        try:
            async with httpx.AsyncClient(timeout=120) as client:
                response = await client.post(root + path)
            if response.status_code >= 400:
                logger.warning(
                    "engine %s answered %d: sleep mode is unsupported here", path, response.status_code
                )
        except httpx.HTTPError as exc:
            logger.warning("engine %s failed: %s", path, exc)

    async def gate(self, name: str, run_id: int) -> GateResult:
        """Evaluate a finished train run's candidate against the active version; promote it if it passes.

        The decision and its numbers go to the run's `metrics["gate"]`; a rejected candidate is marked
        `rejected` and nothing that serves changes.
        """
        async with self.database.session() as session:
            policy = await get_policy(session, name)
            run = await get_run(session, run_id)
        if policy is None or run is None or run.to_version is None:
            raise LookupError(f"run {run_id} of {name!r} has no candidate version")
        candidate = run.to_version
        policy_config = load_policy_config(policy.config)
        config = policy_config.gate
        if policy.active_version is None:
            result = GateResult("promote", candidate, -1, ["no active version to compare with"])
        else:
            try:
                # Agent tasks are attempted whole: with the tools that may run outside traffic, else replayed.
                async with (
                    Scorer(
                        policy_config.rewards, self.config.judge, webhook_secret=self.config.webhook_secret
                    ) as scorer,
                    ToolBox(policy_config.tools, for_resampling=True) as tools,
                ):
                    sampler = VersionSampler(
                        self.config.gate_url,
                        self.config.gateway_key(policy.project),
                        config,
                        tools=tools,
                        max_turns=policy_config.train.max_turns,
                    )
                    result = await evaluate(
                        self.database,
                        name,
                        run,
                        candidate,
                        policy.active_version,
                        scorer=scorer,
                        sampler=sampler,
                        config=config,
                    )
            except Exception as exc:
                logger.exception("the gate could not evaluate %s@%d", name, candidate)
                result = GateResult(
                    "reject", candidate, policy.active_version, [f"evaluation failed: {exc!r}"]
                )
        async with self.database.session() as session:
            await update_run(
                session,
                run.id,
                status="succeeded" if result.passed else "rejected",
                metrics_update={"gate": result.as_dict()},
            )
            if not result.passed:
                await set_adapter_status(session, policy.id, candidate, "rejected")
            await session.commit()
            if result.passed and config.promote:
                await ship(session, policy, run.id, candidate)
        return result

    async def watch_rollouts(self) -> None:
        """One look of the canary monitor at every running rollout; a shadow's new pairs are scored first."""
        await watch(self.database, before_look=self._score_shadow)

    async def _score_shadow(self, rollout: RolloutInfo) -> None:
        if rollout.mode != "shadow":
            return
        async with self.database.session() as session:
            policy = await get_policy(session, rollout.policy)
        if policy is None:
            return
        rewards = load_policy_config(policy.config).rewards
        async with Scorer(rewards, self.config.judge, webhook_secret=self.config.webhook_secret) as scorer:
            await score_shadow_pairs(self.database, rollout, scorer)


async def ship(session: AsyncSession, policy: PolicyInfo, run_id: int, candidate: int) -> str:
    """What happens to a candidate that passed the gate: promoted at once, or put on trial (a canary or a
    shadow) when the policy's `rollout` section asks for one and there is an active version to compare with. A
    trial still running for an older candidate is superseded: the new one was trained on fresher data. Returns
    `promoted`, `canary` or `shadow`."""
    rule = load_policy_config(policy.config).rollout
    trial = rule.trial()
    if trial is None or policy.active_version is None:
        await promote(session, policy.name, candidate)
        logger.info("promoted %s@%d", policy.name, candidate)
        return "promoted"
    mode, share = trial
    running = await running_rollout(session, policy.name)
    if running is not None:
        await end_rollout(
            session,
            running.id,
            "stopped",
            reason=f"superseded by version {candidate} (run {run_id})",
            actor=ACTOR,
        )
    rollout = await start_rollout(
        session,
        policy.name,
        candidate,
        mode=mode,
        share=share,
        actor=ACTOR,
        run_id=run_id,
        config=rule.model_dump(mode="json"),
    )
    started = {"id": rollout.id, "mode": mode, "share": share, "status": "running"}
    await update_run(session, run_id, metrics_update={"rollout": started})
    await session.commit()
    logger.info("%s of %s@%d started on %.0f%% of calls", mode, policy.name, candidate, share * 100)
    return mode


async def drop_expired_days(database: Database, unowned_days: float) -> DroppedDays:
    """PostgreSQL: drop the day partitions of `calls` whose every call is past its owner's retention (each
    policy's `schedule.retention.calls_days`, `unowned_days` for calls no policy owns; 0 keeps them), before the
    row-by-row deletes of a retention job (which then find little left)."""
    now = _now()
    async with database.session() as session:
        cutoffs: dict[str, datetime | None] = {}
        for policy in await list_policies(session):
            try:
                days = load_policy_config(policy.config).schedule.retention.calls_days
            except InvalidPolicyConfig:
                days = None  # unreadable: keep its calls
            cutoffs[policy.name] = now - timedelta(days=days) if days is not None else None
    unowned = now - timedelta(days=unowned_days) if unowned_days > 0 else None
    async with database.engine.connect() as connection:
        return await drop_expired_partitions(connection, cutoffs, unowned)


def _remove_dirs(store: Path, paths: Sequence[str]) -> None:
    """Delete pruned versions' directories, never anything outside the adapter store."""
    root = store.resolve()
    for raw in paths:
        path = Path(raw).resolve()
        if path.is_relative_to(root) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)


def _forward_failure(task: asyncio.Task[Any], announced: asyncio.Future[int]) -> None:
    """Hand a job's early failure (busy, unknown policy) to whoever waits for its run id; log later ones."""
    if announced.done():
        if not task.cancelled() and task.exception() is not None:
            logger.error("background job failed", exc_info=task.exception())
        return
    if task.cancelled():
        announced.cancel()
    elif task.exception() is not None:
        announced.set_exception(task.exception())  # type: ignore[arg-type]
    else:
        announced.set_result(task.result())


# ---------------------------------------------------------------------- the schedule
def catch_up_time(last: datetime | None, now: datetime, interval_s: float) -> datetime:
    """First run of an interval job: one interval after the last run, or now if that passed (coalesced)."""
    if last is None:
        return now + timedelta(seconds=interval_s)
    return max(now, last + timedelta(seconds=interval_s))


def missed_fire_time(expression: str, last: datetime | None, now: datetime) -> datetime | None:
    """The first time the cron fired after the last run, when that is before now (the process was down)."""
    if last is None:
        return None
    following = parse_cron(expression).get_next_fire_time(None, last + timedelta(seconds=1))
    return following if following is not None and following <= now else None


def previous_fire_time(expression: str, now: datetime, lookback_s: float) -> datetime | None:
    """The cron's latest firing at or before `now`, looking back at most `lookback_s`."""
    trigger = parse_cron(expression)
    latest = None
    moment = trigger.get_next_fire_time(None, now - timedelta(seconds=lookback_s))
    while moment is not None and moment <= now:
        latest = moment
        moment = trigger.get_next_fire_time(latest, latest + timedelta(seconds=1))
    return latest


def schedule_slot(config: ScheduleConfig, kind: JobKind, trigger: str, now: datetime) -> datetime | None:
    """Since when a run of `kind` counts as this firing's run: every replica's scheduler fires each job, and
    the first to take the policy's lock runs it; the others find a run started in the slot and skip.

    An interval job's slot is the last half interval (replicas fire at their own phases), a cron job's starts
    at the cron's latest firing. Threshold and manual runs have none (the threshold is re-counted).
    """
    if trigger == "interval" and kind == "judge" and config.judge_interval_s is not None:
        return now - timedelta(seconds=config.judge_interval_s / 2)
    if trigger in ("cron", "catch-up"):
        cron = (
            config.train_cron if kind == "train" else config.retention.cron if kind == "retention" else None
        )
        if cron is not None:
            return previous_fire_time(cron, now, config.misfire_grace_s + 60)
    return None


class OverlapsAtDebug(logging.Filter):
    """APScheduler warns whenever a job fires while its previous firing still runs. With one instance per job
    that is the design, not a fault: a threshold check that started training outlasts many of its own
    intervals. Those lines go to DEBUG; every other line passes unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "maximum number of running instances reached" not in record.getMessage():
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


class PolicyScheduler:
    """APScheduler (AsyncIOScheduler) jobs per policy, re-read from `policies.config` every `refresh_s`."""

    def __init__(
        self, database: Database, runner: JobRunner, refresh_s: float = 30.0, rollout_check_s: float = 60.0
    ) -> None:
        self.database = database
        self.runner = runner
        self.refresh_s = refresh_s
        self.rollout_check_s = rollout_check_s
        self._scheduler: Any = None
        self._fingerprints: dict[str, str] = {}

    async def start(self) -> None:
        from apscheduler.schedulers.asyncio import AsyncIOScheduler

        # APScheduler logs every execution at INFO (the sync job: twice a refresh); the jobs log their own.
        logging.getLogger("apscheduler.executors.default").setLevel(logging.WARNING)
        overlaps = logging.getLogger("apscheduler.scheduler")
        if not any(isinstance(f, OverlapsAtDebug) for f in overlaps.filters):
            overlaps.addFilter(OverlapsAtDebug())
        self._scheduler = AsyncIOScheduler(
            timezone=UTC, job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": 3600}
        )
        self._scheduler.start()
        self._scheduler.add_job(
            self.sync, "interval", seconds=self.refresh_s, id="kaizen:sync", next_run_time=_now()
        )
        self._scheduler.add_job(
            self.runner.watch_rollouts, "interval", seconds=self.rollout_check_s, id="kaizen:rollouts"
        )
        logger.info("scheduler started (policies re-read every %.0f s)", self.refresh_s)

    async def stop(self) -> None:
        """No new firings, then the running jobs end through the runner (a training child killed, its run
        recorded, the engine woken), then the scheduler goes: shut down first, it would cancel them itself and
        log each as a failed job."""
        if self._scheduler is not None:
            self._scheduler.pause()
        await self.runner.close()
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=False)
            self._scheduler = None

    def jobs(self) -> list[tuple[str, datetime | None]]:
        """(job id, next run time) of every policy job, for inspection."""
        if self._scheduler is None:
            return []
        return [
            (job.id, job.next_run_time)
            for job in self._scheduler.get_jobs()
            if not job.id.startswith("kaizen:")
        ]

    async def sync(self) -> None:
        """Bring the jobs in line with every policy's schedule (added, changed, paused, removed)."""
        try:
            async with self.database.session() as session:
                policies = await list_policies(session)
                last = {
                    (p.name, kind): await last_run_at(session, p.id, kind)
                    for p in policies
                    for kind in JOB_KINDS
                }
        except Exception as exc:
            logger.warning("could not read the policies' schedules: %s", exc)
            return
        seen = set()
        for policy in policies:
            seen.add(policy.name)
            try:
                config = load_policy_config(policy.config).schedule
            except InvalidPolicyConfig as exc:
                logger.warning("policy %s has an invalid configuration; its jobs stop: %s", policy.name, exc)
                config = ScheduleConfig(paused=True)
            fingerprint = json.dumps(config.model_dump(mode="json"), sort_keys=True)
            if self._fingerprints.get(policy.name) == fingerprint:
                continue
            self._fingerprints[policy.name] = fingerprint
            self._remove(policy.name)
            if not config.paused:
                self._add(policy.name, config, {kind: last[(policy.name, kind)] for kind in JOB_KINDS})
        for name in set(self._fingerprints) - seen:
            del self._fingerprints[name]
            self._remove(name)

    def _remove(self, policy: str) -> None:
        for job in self._scheduler.get_jobs():
            if job.id.startswith(f"{policy}:"):
                job.remove()

    def _add(self, policy: str, config: ScheduleConfig, last: dict[str, datetime | None]) -> None:
        now = _now()
        grace = int(config.misfire_grace_s)
        common = {"coalesce": True, "max_instances": 1, "misfire_grace_time": grace, "replace_existing": True}
        if config.judge_interval_s is not None:
            self._scheduler.add_job(
                self.fire,
                "interval",
                args=[policy, "judge", "interval"],
                seconds=config.judge_interval_s,
                id=f"{policy}:judge",
                next_run_time=catch_up_time(last["judge"], now, config.judge_interval_s),
                **common,
            )
        for kind, cron in (("train", config.train_cron), ("retention", config.retention.cron)):
            if cron is None:
                continue
            self._scheduler.add_job(
                self.fire, parse_cron(cron), args=[policy, kind, "cron"], id=f"{policy}:{kind}", **common
            )
            missed = missed_fire_time(cron, last[kind], now)
            if missed is not None:
                self._scheduler.add_job(
                    self.fire,
                    "date",
                    args=[policy, kind, "catch-up", missed],
                    id=f"{policy}:{kind}:catch-up",
                    run_date=now,
                    **common,
                )
        if config.train_min_new_episodes is not None:
            self._scheduler.add_job(
                self.check_threshold,
                "interval",
                args=[policy, config.train_min_new_episodes],
                seconds=config.threshold_check_s,
                id=f"{policy}:threshold",
                next_run_time=now,
                **common,
            )

    async def fire(
        self, policy: str, kind: JobKind, trigger: str, slot_start: datetime | None = None
    ) -> None:
        """A scheduled run: skipped when the policy was paused since the last sync, another job runs, or another
        replica's scheduler ran this slot of the schedule already (`schedule_slot`)."""
        try:
            async with self.database.session() as session:
                info = await get_policy(session, policy)
            if info is None:
                return
            config = load_policy_config(info.config).schedule
            if config.paused:
                return
            slot = slot_start or schedule_slot(config, kind, trigger, _now())
            await self.runner.run(policy, kind, trigger, slot)
        except Exception:
            logger.exception("scheduled %s job of %s failed", kind, policy)

    async def check_threshold(self, policy: str, threshold: int) -> None:
        try:
            async with self.database.session() as session:
                info = await get_policy(session, policy)
                if info is None:
                    return
                fresh = await count_rewarded_episodes(
                    session, policy, await last_data_cutoff(session, info.id)
                )
        except Exception as exc:
            logger.warning("could not count new episodes of %s: %s", policy, exc)
            return
        if fresh >= threshold:
            logger.info("%s: %d newly rewarded episodes (threshold %d): training", policy, fresh, threshold)
            await self.fire(policy, "train", "threshold")
