"""One training run of a policy, end to end: lock ▶ select ▶ group ▶ tokenise ▶ GRPO (or SFT, `trainer.learner.sft`)
▶ adapter N+1.

This is what ``kaizen train`` runs, in its own process. The policy's job lock (``storage.locks``) keeps it apart
from every other job of the policy across processes and machines; a heartbeat renews it, and a crashed run's lock
expires. Started by the scheduler or by ``kaizen train``, the run inherits the lock its parent holds. The new
version is written to a temporary directory and renamed into place, and its ``adapters`` row (``candidate``) and
the ``training_runs`` outcome are committed together, so an interrupted run leaves no half-written version.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from storage.adapter_store import publish_version
from storage.database import Database
from storage.locks import heartbeat, lock_owner, release_lock, renew_lock
from storage.policies import PolicyInfo, add_adapter, get_adapter, get_policy
from storage.training import (
    episode_calls,
    finish_run,
    last_data_cutoff,
    rewarded_episodes,
    start_run,
    take_policy_lock,
)
from trainer.control.child_processes import PARENT_DEATH_SIGNAL
from trainer.control.gate import is_held_out
from trainer.control.policy_config import PolicyConfig, TrainConfig, load_policy_config
from trainer.control.rollouts import hermes_message
from trainer.control.signals import SigtermAsCtrlC
from trainer.control.tools import ToolBox
from trainer.learner.dataset import DataReport, TrainingExample, build_example, select_episodes
from trainer.learner.engine_sampling import EngineEndpoint
from trainer.learner.grouping import (
    Group,
    ReplyScorer,
    Sampler,
    group_by_column,
    group_stats,
    resample_groups,
)
from trainer.learner.tracking import Tracker, open_tracker

if TYPE_CHECKING:  # torch is imported by the training phase only, never by the job's callers
    from sqlalchemy.ext.asyncio import AsyncSession

    from trainer.control.launch import Ranks
    from trainer.learner.batch import TokenizedSample
    from trainer.learner.distributed import Followers
    from trainer.learner.grpo import ScoreReplies
    from trainer.learner.sft import Phase

logger = logging.getLogger(__name__)


class TrainingBusy(RuntimeError):
    """Another live job of the policy holds its job lock."""


@dataclass(frozen=True)
class TrainRequest:
    """What a run needs besides the database: the policy, where files go, and how `resample` groups are made."""

    policy: str
    data_dir: Path
    #: Local directory of the base model (the CLI resolves embedded names before calling).
    base_model_path: str
    overrides: dict[str, Any] = field(default_factory=dict)
    since: datetime | None = None
    until: datetime | None = None
    #: Scores resampled replies; required for `resample` grouping.
    scorer: ReplyScorer | None = None
    #: Where resampled replies come from: the serving engine behind this gateway URL (exact behaviour logprobs
    #: of what is served), or None for the trainer's own copy of the adapter (`LocalSampler`).
    sampler: EngineEndpoint | None = None
    device: str | None = None
    #: This process is rank 0 of several training processes (torchrun); the others run `follow`.
    followers: Followers | None = None
    #: Train under this owner's job lock (the scheduler's job holds it); None: take the policy's lock.
    lock_owner: str | None = None
    #: The command's signal handling, which says what stopped the run (None: not known).
    interrupt: SigtermAsCtrlC | None = None


@dataclass
class TrainOutcome:
    run_id: int
    status: str  # succeeded | skipped | failed
    version: int | None
    adapter_path: str | None
    metrics: dict[str, Any]
    error: str | None = None


async def _load_trajectories(
    db: Database, policy: PolicyInfo, config: PolicyConfig, request: TrainRequest, report: DataReport
) -> tuple[list[TrainingExample], datetime | None, datetime]:
    until = request.until or datetime.now(UTC)
    async with db.session() as session:
        since = request.since if request.since is not None else await last_data_cutoff(session, policy.id)
        episodes = select_episodes(
            await rewarded_episodes(session, policy.name, since=since, until=until), config.train, report
        )
        # Groups the evaluation gate keeps out are never trained on, so the gate judges unseen tasks.
        holdout = config.gate.holdout_fraction
        kept = [e for e in episodes if not is_held_out(e.group_key or e.id, holdout)]
        report.add("held_out_for_gate", len(episodes) - len(kept))
        episodes = kept
        first = min((e.created_at for e in episodes), default=None)
        calls = await episode_calls(session, [e.id for e in episodes], since=first)
    trajectories = []
    for episode in episodes:
        trajectory = build_example(episode, calls.get(episode.id, []), report)
        if trajectory is not None:
            trajectories.append(trajectory)
    return trajectories, since, until


def _check_scorer(
    scorer: ReplyScorer | None,
    checked: list[TrainingExample],
    loop: asyncio.AbstractEventLoop,
) -> ScoreReplies | None:
    """The collapse checks' reward evidence: the policy's scorer on replies to the i-th checked start (with the
    captured conversation that began there, which a relative judge needs), called from the update's worker
    thread on the run's event loop. A reply is read as the engine would (tool calls from their text). A scorer
    that fails leaves the replies unscored."""
    if scorer is None:
        return None

    def score(index: int, replies: list[str]) -> list[float | None]:
        example = checked[index]
        conversations = [
            [
                *example.start,
                hermes_message(reply) if example.tools else {"role": "assistant", "content": reply},
            ]
            for reply in replies
        ]
        future = asyncio.run_coroutine_threadsafe(scorer.score(conversations, example.messages), loop)
        try:
            return future.result()
        except Exception as exc:
            logger.warning("scoring the collapse check's replies failed: %r", exc)
            return [None] * len(replies)

    return score


def interrupted_reason(interrupt: SigtermAsCtrlC | None) -> str:
    """What a run stopped by a signal records. A training child's parent-death signal
    (`trainer.control.child_processes`) says that what started it (a gateway, `kaizen worker` or `kaizen train`)
    died: saying so sends the operator to that process, not looking for someone who stopped the run."""
    if parent_died(interrupt):
        return f"interrupted: the process that started it died ({PARENT_DEATH_SIGNAL.name})"
    return "interrupted"


def parent_died(interrupt: SigtermAsCtrlC | None) -> bool:
    """Whether the run was stopped by its training child's parent-death signal."""
    return interrupt is not None and interrupt.signal == PARENT_DEATH_SIGNAL


async def run_training(db: Database, request: TrainRequest) -> TrainOutcome:
    """Train the policy once; raises `TrainingBusy` if another job holds the policy's lock."""
    async with db.session() as session:
        policy = await get_policy(session, request.policy)
    if policy is None:
        raise ValueError(f"unknown policy {request.policy!r}")
    config = load_policy_config(policy.config, train_overrides=request.overrides)
    cfg = config.train
    if cfg.grouping == "resample" and cfg.mode != "sft" and request.scorer is None:
        raise ValueError("`resample` grouping needs a scorer for the generated replies; none is configured")
    # The scheduler's training child runs under the lock of the job that started it.
    inherited = request.lock_owner
    owner = inherited or lock_owner()
    async with db.session() as session:
        if inherited:  # the parent that handed its lock down has failed abandoned runs already
            held = await renew_lock(session, policy.name, owner, cfg.lock_ttl_s)
        else:
            held = await take_policy_lock(session, policy, owner, "train", cfg.lock_ttl_s)
    if not held:
        raise TrainingBusy(f"another job of policy {policy.name!r} is running")
    stop = threading.Event()
    try:
        async with db.session() as session:
            run_id = await start_run(session, policy.id, policy.active_version, cfg.model_dump(mode="json"))
            await session.commit()
        logger.info(
            "training run %d of policy %s started (mode %s, grouping %s)",
            run_id,
            policy.name,
            cfg.mode,
            cfg.grouping,
        )
        tracker = Tracker()
        async with heartbeat(db, policy.name, owner, cfg.lock_ttl_s, on_lost=stop.set):
            try:
                # Inside the heartbeat: an unreachable tracking server can take its client minutes to give up.
                tracker = await asyncio.to_thread(
                    open_tracker, cfg, policy=policy.name, run_id=run_id, from_version=policy.active_version
                )
                outcome = await _train(db, policy, config, request, run_id, stop)
            except BaseException as exc:
                stop.set()  # a worker thread still in the update loop stops at its next micro-batch
                reason = (
                    interrupted_reason(request.interrupt)
                    if isinstance(exc, asyncio.CancelledError | KeyboardInterrupt)
                    else repr(exc)
                )
                logger.error("training run %d failed: %s", run_id, reason)
                async with db.session() as session:
                    await finish_run(session, run_id, status="failed", metrics={}, error=reason)
                    await session.commit()
                await asyncio.to_thread(tracker.finish, "failed", {}, error=reason)
                raise
            await asyncio.to_thread(
                tracker.finish, outcome.status, outcome.metrics, version=outcome.version, error=outcome.error
            )
            return outcome
    finally:
        # An inherited lock is its parent's to release, unless the parent died: then nobody else is left to, and
        # the policy would stay locked for `lock_ttl_s`.
        if not inherited or parent_died(request.interrupt):
            async with db.session() as session:
                await release_lock(session, policy.name, owner)


async def _train(
    db: Database,
    policy: PolicyInfo,
    config: PolicyConfig,
    request: TrainRequest,
    run_id: int,
    stop: threading.Event,
) -> TrainOutcome:
    import torch

    from trainer.learner.grpo import peft_model
    from trainer.learner.model import LocalSampler, load_policy, pick_device, save_adapter
    from trainer.learner.sft import demonstrations, load_vouched, plan_phases
    from trainer.learner.tokens import Turns, mask_shared_tokens, tokenize

    cfg = config.train
    started = time.perf_counter()
    report = DataReport()
    trajectories, since, until = await _load_trajectories(db, policy, config, request, report)
    window = {"data_since": since.isoformat() if since else None, "data_until": until.isoformat()}

    async def finish(
        status: str, metrics: dict[str, Any], version: int | None = None, error: str | None = None
    ) -> None:
        async with db.session() as session:
            await finish_run(
                session,
                run_id,
                status=status,
                metrics=metrics,
                to_version=version,
                error=error,
                config_update=window,
            )
            await session.commit()

    ranks = request.followers.ranks if request.followers is not None else None
    vouched = []
    if cfg.mode != "grpo":
        vouched = await load_vouched(db, policy.name, cfg, since, until, report)
    if not trajectories and not vouched:
        await _tell_followers(None, request.followers)
        empty = {"data": report.as_dict(), "wall_s": time.perf_counter() - started}
        await finish("skipped", empty, error="no rewarded trajectories in the window")
        return TrainOutcome(run_id, "skipped", None, None, empty, "no rewarded trajectories in the window")

    adapter_path: str | None = None
    if policy.active_version is not None:
        async with db.session() as session:
            active = await get_adapter(session, policy.id, policy.active_version)
        adapter_path = active.path if active is not None else None
    device = torch.device(request.device) if request.device else pick_device()
    if ranks is not None:
        device = torch.device("cuda", ranks.local_rank) if device.type == "cuda" else device
    loading = ("load", request.base_model_path, adapter_path, cfg.model_dump(mode="json"), device.type)
    await _tell_followers(loading, request.followers)
    model, tokenizer = await asyncio.to_thread(
        load_policy, request.base_model_path, adapter_path, cfg, device
    )

    groups: list[Group] = []
    resampling: dict[str, Any] | None = None
    if cfg.mode == "sft":
        pass  # demonstrations only: no groups to form or resample
    elif cfg.grouping == "resample":
        assert request.scorer is not None
        sampler: Sampler
        if request.sampler is not None:
            # The version the trainer loaded; a policy without one is served (and trained from) the base model.
            served = (
                f"{policy.name}@{policy.active_version}"
                if policy.active_version is not None
                else policy.base_model
            )
            logger.info("resampling %s through the serving engine at %s", served, request.sampler.base_url)
            sampler = request.sampler.sampler(
                served, tokenizer, max_tokens=cfg.max_new_tokens, temperature=cfg.temperature
            )
        else:
            sampler = LocalSampler(
                model, tokenizer, device, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature
            )
        # The policy's tools that may run while training re-run agent episodes; the others are replayed.
        async with ToolBox(config.tools, for_resampling=True) as tools:
            groups, resampling = await resample_groups(
                trajectories, cfg, sampler, request.scorer, report, tools=tools
            )
        if tools.unavailable:
            resampling["tools_unavailable"] = tools.unavailable
    else:
        groups, resampling = group_by_column(trajectories, cfg, report), None
    # A `resample` group shares each member's start, so only the agent's turns after it are attempts; `key` and
    # `prompt` groups compare whole episodes. Tokens every member sampled alike get no push either way.
    turns: Turns = "agent" if cfg.grouping == "resample" else "all"
    samples: list[TokenizedSample] = []
    for group in groups:
        members = [
            tokenize(member, advantage, tokenizer, cfg, report, turns)
            for member, advantage in zip(group.members, group.advantages, strict=True)
        ]
        samples.extend(sample for member in mask_shared_tokens(members, report) for sample in member)
    demos, demonstrated = demonstrations(cfg, [*trajectories, *vouched], groups, tokenizer, report)
    metrics: dict[str, Any] = {
        **group_stats(groups),
        "samples": len(samples),
        "mode": cfg.mode,
        "demonstrations": len(demos),
    }
    if resampling is not None:
        metrics["resample"] = resampling
    phases = plan_phases(cfg, samples, demos)
    if not phases:
        reason = {
            "grpo": "no group with reward variance",
            "sft": f"no demonstrations (no reply reached sft_min_reward {cfg.sft_min_reward})",
        }.get(cfg.mode, "no group with reward variance and no demonstrations")
        await _tell_followers(None, request.followers)
        metrics.update(data=report.as_dict(), wall_s=time.perf_counter() - started)
        await finish("skipped", metrics, error=reason)
        return TrainOutcome(run_id, "skipped", None, None, metrics, reason)

    # The collapse checks sample where the groups' attempts start: an agent's first turn (often its tool call).
    checked = [g.members[0] for g in groups] or list(demonstrated)  # SFT only: the demonstrations' starts
    contexts = [(example.start, example.tools) for example in checked]
    score = _check_scorer(request.scorer, checked, asyncio.get_running_loop())
    await _tell_followers(("train", phases, contexts), request.followers)
    result, monitor, model, state = await asyncio.to_thread(
        update_together, model, tokenizer, phases, contexts, cfg, device, ranks, stop, score
    )
    metrics.update(result.metrics)
    metrics.update(
        data=report.as_dict(),
        collapse=monitor.history,
        history=result.history,
        stopped_early=result.stopped_early,
        wall_s=time.perf_counter() - started,
    )
    last = monitor.history[-1] if monitor.history else {}
    if "mean_kl" not in metrics and last.get("kl_to_base") is not None:
        metrics["kl_to_base"] = last["kl_to_base"]
    if last.get("kl_to_start") is not None:
        metrics["kl_to_start"] = last["kl_to_start"]
    if result.stopped_early:
        error = "collapse guard stopped the run: " + "; ".join(result.problems)
        await finish("failed", metrics, error=error)
        logger.warning("run %d wrote no adapter: %s", run_id, error)
        return TrainOutcome(run_id, "failed", None, None, metrics, error)

    async def record(session: AsyncSession, version: int, target: Path) -> None:
        await add_adapter(
            session,
            policy.id,
            version,
            str(target),
            status="candidate",
            parent_version=policy.active_version,
            metrics={k: v for k, v in metrics.items() if isinstance(v, int | float)},
        )
        await finish_run(
            session, run_id, status="succeeded", metrics=metrics, to_version=version, config_update=window
        )

    trained = peft_model(model)
    version, target = await publish_version(
        db, policy, request.data_dir, lambda target: save_adapter(trained, target, state), record
    )
    logger.info(
        "run %d wrote %s@%d to %s (%d groups, %d samples, %d demonstrations, %.0f tokens/s, %.1f s)",
        run_id,
        policy.name,
        version,
        target,
        metrics["groups"],
        len(samples),
        len(demos),
        metrics["tokens_per_s"],
        metrics["wall_s"],
    )
    return TrainOutcome(run_id, "succeeded", version, str(target), metrics)


def update_together(
    model: Any,
    tokenizer: Any,
    phases: Sequence[Phase],
    contexts: list[tuple[list[dict[str, Any]], list[Any] | None]],
    cfg: TrainConfig,
    device: Any,
    ranks: Ranks | None,
    stop: threading.Event | None,
    score: ScoreReplies | None = None,
) -> tuple[Any, Any, Any, dict[str, Any] | None]:
    """The update's phases (with their collapse checks), run by every training process alike: (result, monitor,
    model, the trainable weights gathered from every process or None when one process trained alone).

    Everything here is collective under several processes, in the same order on each of them. Only rank 0 has
    the scorer; its checks' verdicts are shared with the others."""
    from trainer.learner.distributed import full_trainable_state, shard
    from trainer.learner.grpo import CollapseMonitor, planned_passes
    from trainer.learner.model import compile_layers
    from trainer.learner.sft import run_phases

    if ranks is not None:
        model = shard(model, cfg.sharding, device)
    else:
        compile_layers(model, cfg, device, sum(planned_passes(len(p.samples), p.cfg) for p in phases))
    monitor = CollapseMonitor(model, tokenizer, contexts, cfg, device, cfg.bounds(), score, ranks=ranks)
    monitor.start()
    result = run_phases(
        model, phases, monitor, pad_id=int(tokenizer.pad_token_id), device=device, stop=stop, ranks=ranks
    )
    state = full_trainable_state(model) if ranks is not None and not result.stopped_early else None
    return result, monitor, model, state


async def _tell_followers(message: Any, followers: Followers | None) -> None:
    """Send the other training processes what to do next (None: nothing, the run ends)."""
    if followers is not None:
        await asyncio.to_thread(followers.tell, message)


def follow(ranks: Ranks) -> None:
    """A training process other than rank 0: load what rank 0 loads (on the kind of device rank 0 trains on),
    train on the samples it sends, hand the weights back. It never touches the database; rank 0 holds the lock
    and records the run."""
    import torch

    from trainer.control.policy_config import TrainConfig
    from trainer.learner.distributed import share
    from trainer.learner.model import load_policy

    told = share(None, ranks)
    if told is None:
        return
    _, base_model_path, adapter_path, dumped, device_type = told
    device = torch.device("cuda", ranks.local_rank) if device_type == "cuda" else torch.device(device_type)
    cfg = TrainConfig.model_validate(dumped)
    model, tokenizer = load_policy(base_model_path, adapter_path, cfg, device)
    told = share(None, ranks)
    if told is None:
        return
    _, phases, contexts = told
    update_together(model, tokenizer, phases, contexts, cfg, device, ranks, None)
