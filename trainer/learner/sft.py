"""Supervised fine-tuning on what went well: which replies are demonstrations, and how `TrainConfig.mode` splits a
run's update into phases.

A demonstration is a reply to imitate: a captured or resampled reply whose reward reached `sft_min_reward`
(positive feedback, a top judged reply, a reward function's full marks), or an unrewarded episode from one of
`demonstration_sources` (conversations a team imported to teach the policy). Only the best `sft_per_context`
replies of each task count, so a task the policy already solves every time does not drown out the rest, and a
reply repeated to the same context counts once.

GRPO learns nothing from a group whose replies all failed, and little from one success among many failures;
imitating that success moves the policy straight to it. SFT cannot learn what to avoid, though, and copies
whatever the reward let through, so the modes combine both: `sft` alone, `warm_start` (SFT first, then GRPO on
the groups, one candidate) and `mixed` (both losses in every step, demonstrations weighted by `sft_coef`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any

from storage.database import Database
from storage.training import episode_calls, unrewarded_episodes
from trainer.control.policy_config import TrainConfig
from trainer.learner.batch import TokenizedSample
from trainer.learner.dataset import DataReport, TrainingExample, build_example
from trainer.learner.distributed import share
from trainer.learner.grpo import CollapseMonitor, UpdateResult, run_update
from trainer.learner.tokens import tokenize

if TYPE_CHECKING:
    import torch

    from trainer.control.launch import Ranks
    from trainer.learner.grouping import Group

#: A context and its tools, as the collapse checks sample them.
Context = tuple[list[dict[str, Any]], list[Any] | None]

logger = logging.getLogger(__name__)

#: `TrainingExample.origin` of an unrewarded episode taken from a demonstration source.
VOUCHED = "demonstration"


def task_key(example: TrainingExample) -> str:
    """What makes two replies attempts at the same task: the group key, else the context."""
    if example.group_key:
        return f"key:{example.group_key}"
    if example.context_hash:
        return f"context:{example.context_hash}"
    text = json.dumps([example.context, example.tools], sort_keys=True, default=str)
    return "context:" + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def select_demonstrations(
    candidates: Sequence[TrainingExample], cfg: TrainConfig, report: DataReport
) -> list[TrainingExample]:
    """The replies to imitate among `candidates` (captured, resampled and vouched-for trajectories), best first.

    Every candidate left out is counted: below `sft_min_reward`, a repeat of a reply already chosen for its
    task, beyond `sft_per_context`, or beyond `sft_max_examples`.
    """
    report.add("sft_candidates", len(candidates))
    # Vouched-for episodes first (a team chose them), then by reward; stable, so ties keep their order.
    ranked = sorted(candidates, key=lambda e: (e.origin != VOUCHED, -e.reward))
    chosen: list[TrainingExample] = []
    per_task: dict[str, int] = defaultdict(int)
    seen: set[tuple[str, str]] = set()
    for example in ranked:
        if example.origin != VOUCHED and example.reward < cfg.sft_min_reward:
            report.add("sft_below_min_reward")
            continue
        task = task_key(example)
        reply = json.dumps(example.reply, sort_keys=True, default=str)
        if (task, reply) in seen:
            report.add("sft_duplicate_replies")
            continue
        seen.add((task, reply))
        if per_task[task] >= cfg.sft_per_context:
            report.add("sft_beyond_per_context")
            continue
        per_task[task] += 1
        chosen.append(example)
    report.add("sft_capped", max(len(chosen) - cfg.sft_max_examples, 0))
    return chosen[: cfg.sft_max_examples]


async def load_vouched(
    db: Database,
    policy: str,
    cfg: TrainConfig,
    since: datetime | None,
    until: datetime,
    report: DataReport,
) -> list[TrainingExample]:
    """Unrewarded episodes of the policy from `demonstration_sources` in the run's window, as trajectories."""
    if not cfg.demonstration_sources:
        return []
    async with db.session() as session:
        episodes = await unrewarded_episodes(
            session, policy, sources=cfg.demonstration_sources, since=since, until=until
        )
        kept = [
            e
            for e in episodes
            if all(t in e.tags for t in cfg.tags) and all(e.meta.get(k) == v for k, v in cfg.metadata.items())
        ]
        report.add("demonstrations_filtered", len(episodes) - len(kept))
        calls = await episode_calls(session, [e.id for e in kept])
    examples = []
    for episode in kept:
        example = build_example(episode, calls.get(episode.id, []), report)
        if example is not None:
            examples.append(example)
    report.add("demonstrations_unrewarded", len(examples))
    return [replace(e, origin=VOUCHED) for e in examples]


def demonstration_samples(
    demonstrations: Sequence[TrainingExample], tokenizer: Any, cfg: TrainConfig, report: DataReport
) -> list[TokenizedSample]:
    """Training samples of the demonstrations, on their captured token ids where there are any."""
    return [
        replace(sample, demonstration=True)
        for example in demonstrations
        for sample in tokenize(example, 0.0, tokenizer, cfg, report, turns="all")
    ]


def demonstrations(
    cfg: TrainConfig,
    examples: Sequence[TrainingExample],
    groups: Sequence[Group],
    tokenizer: Any,
    report: DataReport,
) -> tuple[list[TokenizedSample], list[TrainingExample]]:
    """The run's demonstration samples and the examples they came from: none in `grpo` mode; otherwise chosen
    among the selected (and vouched-for) trajectories and the groups' resampled replies."""
    if cfg.mode == "grpo":
        return [], []
    resampled = [m for g in groups for m in g.members[1:]]
    chosen = select_demonstrations([*examples, *resampled], cfg, report)
    return demonstration_samples(chosen, tokenizer, cfg, report), chosen


@dataclass(frozen=True)
class Phase:
    """One call of the update loop: its samples, the configuration it runs with and the SFT term's weight."""

    name: str  # sft | grpo | mixed
    samples: list[TokenizedSample]
    cfg: TrainConfig
    sft_weight: float = 1.0


def plan_phases(
    cfg: TrainConfig, attempts: list[TokenizedSample], demonstrations: list[TokenizedSample]
) -> list[Phase]:
    """The update as `cfg.mode` asks for it, leaving out a phase that has no samples.

    SFT phases run at `sft_learning_rate` for `sft_epochs`; the GRPO and mixed phases at the run's own settings.
    """
    sft = cfg.model_copy(update={"learning_rate": cfg.sft_learning_rate, "epochs": cfg.sft_epochs})
    phases: list[Phase] = []
    if cfg.mode in ("sft", "warm_start") and demonstrations:
        phases.append(Phase("sft", demonstrations, sft))
    if cfg.mode in ("grpo", "warm_start") and attempts:
        phases.append(Phase("grpo", attempts, cfg))
    if cfg.mode == "mixed" and (attempts or demonstrations):
        phases.append(Phase("mixed", [*attempts, *demonstrations], cfg, sft_weight=cfg.sft_coef))
    return phases


@dataclass
class PhaseMetrics:
    """The metrics of a run's phases, merged: counts and times add up, loss figures come from their phase."""

    phases: list[dict[str, Any]] = field(default_factory=list)

    def add(self, name: str, metrics: dict[str, float]) -> None:
        self.phases.append({"phase": name, **metrics})

    def merged(self) -> dict[str, Any]:
        total: dict[str, Any] = {}
        for phase in self.phases:
            for key, value in phase.items():
                if key in ("steps", "loss_tokens", "tokens", "update_s", "sft_tokens"):
                    total[key] = total.get(key, 0.0) + value
                elif key != "phase":
                    total[key] = value
        if total.get("update_s"):
            total["tokens_per_s"] = total.get("tokens", 0.0) / total["update_s"]
        if len(self.phases) > 1:
            total["phases"] = self.phases
        return total


def run_phases(
    model: Any,
    phases: Sequence[Phase],
    monitor: CollapseMonitor,
    *,
    pad_id: int,
    device: torch.device,
    stop: threading.Event | None,
    ranks: Ranks | None = None,
) -> UpdateResult:
    """Run the phases in order under one collapse monitor (its steps counted across phases); a phase that stops
    early stops the run, and the final check follows the last phase. With `ranks`, every training process runs
    this alike, and rank 0's verdict of the final check is everyone's."""
    merged = PhaseMetrics()
    done = 0
    result = UpdateResult()
    for phase in phases:
        logger.info("%s phase: %d samples", phase.name, len(phase.samples))

        def check(step: int, offset: int = done) -> list[str]:
            return monitor(offset + step)

        result = run_update(
            model,
            phase.samples,
            phase.cfg,
            pad_id=pad_id,
            device=device,
            collapse_check=check,
            stop=stop,
            sft_weight=phase.sft_weight,
            ranks=ranks,
        )
        done += result.steps
        merged.add(phase.name, result.metrics)
        if result.stopped_early:
            break
    if not result.stopped_early:
        problems = monitor(done)
        if ranks is not None:
            problems = share(problems, ranks) or []
        if problems:
            result.stopped_early, result.problems = True, problems
    result.steps = done
    result.metrics = merged.merged()
    return result
