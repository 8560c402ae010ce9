"""The canary monitor: promotes a version on trial to every call, or rolls it back, on live evidence.

Every `KAIZEN_ROLLOUT_CHECK_S` the scheduler reads each running rollout's evidence over the same window (since it
started) for both versions, and decides:

1. Health (canary only). The guards of `trainer.control.live_health` on the calls each version served: a
   candidate that fails, empties, refuses, loops or breaks tools more than the baseline is rolled back at once.
2. Reward. Episodes count for the version that served their first call, with their reward whenever it arrived,
   so rewards given hours later still count for that version. With at least `min_episodes` rewarded episodes on
   each side (a shadow: scored pairs), the always-valid confidence sequence of `trainer.control.sequential`
   for d = mean(candidate) - mean(baseline) decides: promote when its low end is above -margin, roll back when
   its high end is below -margin. The sequence holds over every look, so checking each minute does not raise
   the false-promotion rate above alpha/(2 - alpha).
3. Time. Undecided after `max_hours`, the rollout ends as `on_timeout` says (rollback by default).

A split set by hand is measured the same way and never decided here. Each decision ends the rollout in the
database (which every gateway's router reads on its next refresh), goes to the audit log as `rollout.promoted`
or `rollout.rolled_back` with the actor `canary`, and into the training run's `metrics["rollout"]`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from sqlalchemy import and_, case, func, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import aliased

from storage.database import Database
from storage.jobs import update_run
from storage.models import Call, Episode, ToolCall
from storage.rollouts import RolloutInfo, RolloutRefused, end_rollout, record_evaluation, running_rollouts
from storage.shadows import paired_differences
from storage.version_rewards import RewardStats, version_rewards
from trainer.control.live_health import LiveHealth, ServedCall, health_problems
from trainer.control.policy_config import RolloutConfig
from trainer.control.sequential import (
    Interval,
    Sample,
    confidence_sequence,
    confidence_sequence_paired,
    decide,
)

logger = logging.getLogger(__name__)

#: The actor decisions are recorded under in the audit log.
ACTOR = "canary"
#: Calls per version the health guards read, the newest first: enough for shares to within a few points.
HEALTH_CALLS = 2000

Decision = Literal["promote", "rollback", "continue"]


@dataclass(frozen=True)
class Arm:
    """One version's evidence over the rollout's window."""

    version: int | None
    rewards: RewardStats
    episodes: int  # every episode whose first call it served, rewarded or not
    health: LiveHealth

    @property
    def feedback_rate(self) -> float | None:
        return self.rewards.episodes / self.episodes if self.episodes else None

    def as_dict(self) -> dict[str, Any]:
        health = self.health
        return {
            "version": self.version,
            "episodes": self.episodes,
            "rewarded": self.rewards.episodes,
            "mean": self.rewards.mean,
            "low": self.rewards.low,
            "high": self.rewards.high,
            "feedback_rate": self.feedback_rate,
            "health": {
                "calls": health.calls,
                "error_share": health.error_share,
                "empty_share": health.empty_share,
                "refusal_share": health.refusal_share,
                "repetition": health.repetition,
                "mean_length": health.mean_length,
                "tool_calls": health.tool_calls,
                "tool_error_share": health.tool_error_share,
            },
        }


@dataclass(frozen=True)
class Paired:
    """A shadow's scored pairs: how many, and the mean and variance of shadow - served reward."""

    n: int
    mean: float
    variance: float


@dataclass(frozen=True)
class Evidence:
    candidate: Arm
    baseline: Arm
    elapsed_s: float
    paired: Paired | None = None  # shadows only


@dataclass(frozen=True)
class Verdict:
    decision: Decision
    reason: str
    interval: Interval | None

    def stats(self, evidence: Evidence) -> dict[str, Any]:
        """What the rollout row keeps of this evaluation (read by the dashboard and /metrics)."""
        estimate = (
            evidence.paired.mean
            if evidence.paired is not None
            else _difference(evidence.candidate.rewards, evidence.baseline.rewards)
        )
        return {
            "candidate": evidence.candidate.as_dict(),
            "baseline": evidence.baseline.as_dict(),
            "paired": None
            if evidence.paired is None
            else {"n": evidence.paired.n, "mean": evidence.paired.mean, "variance": evidence.paired.variance},
            "difference": {
                "estimate": estimate,
                "low": self.interval.low if self.interval else None,
                "high": self.interval.high if self.interval else None,
            },
            "decision": self.decision,
            "reason": self.reason,
            "elapsed_s": evidence.elapsed_s,
            "evaluated_at": datetime.now(UTC).isoformat(),
        }


def _difference(candidate: RewardStats, baseline: RewardStats) -> float | None:
    if candidate.mean is None or baseline.mean is None:
        return None
    return candidate.mean - baseline.mean


def _sample(stats: RewardStats) -> Sample:
    return Sample(stats.episodes, stats.mean or 0.0, (stats.std or 0.0) ** 2)


def judge(mode: str, evidence: Evidence, config: RolloutConfig) -> Verdict:
    """The decision on one look at a rollout's evidence (pure: the monitor gathers, this decides)."""
    candidate, baseline = evidence.candidate, evidence.baseline
    if mode == "canary":
        problems = health_problems(
            candidate.health, baseline.health, config.bounds(), alpha=config.alpha, min_calls=config.min_calls
        )
        if problems:
            return Verdict("rollback", "health: " + "; ".join(problems), None)
    if evidence.paired is not None:
        pairs = evidence.paired
        interval = confidence_sequence_paired(
            pairs.n, pairs.mean, pairs.variance, alpha=config.alpha, tau=config.tau
        )
        enough = pairs.n >= config.min_episodes
        counts = f"{pairs.n} scored pairs"
    else:
        interval = confidence_sequence(
            _sample(candidate.rewards), _sample(baseline.rewards), alpha=config.alpha, tau=config.tau
        )
        enough = min(candidate.rewards.episodes, baseline.rewards.episodes) >= config.min_episodes
        counts = f"{candidate.rewards.episodes} vs {baseline.rewards.episodes} rewarded episodes"
    decision: Decision = decide(interval, margin=config.margin, min_samples_met=enough)
    if mode == "split":  # measured, decided by hand
        return Verdict("continue", f"split: {counts}", interval)
    bounds = f"[{interval.low:+.3f}, {interval.high:+.3f}]" if interval is not None else "undefined"
    if decision == "promote":
        return Verdict(
            "promote", f"no worse: difference {bounds} above -{config.margin:g} ({counts})", interval
        )
    if decision == "rollback":
        return Verdict(
            "rollback", f"worse: difference {bounds} below -{config.margin:g} ({counts})", interval
        )
    if evidence.elapsed_s >= config.max_hours * 3600:
        return Verdict(
            "promote" if config.on_timeout == "promote" else "rollback",
            f"undecided after {config.max_hours:g} h: difference {bounds} ({counts}); on_timeout "
            f"{config.on_timeout}",
            interval,
        )
    return Verdict("continue", f"undecided: difference {bounds} ({counts})", interval)


async def _served(
    session: AsyncSession, policy: str, version: int | None, since: datetime
) -> list[ServedCall]:
    rows = await session.execute(
        select(Call.status, Call.response)
        .where(Call.policy == policy, Call.adapter_version == version, Call.created_at >= since)
        .order_by(Call.created_at.desc())
        .limit(HEALTH_CALLS)
    )
    served = []
    for status, response in rows:
        choices = (response or {}).get("choices") or [{}]
        message = choices[0].get("message") if isinstance(choices[0], dict) else None
        served.append(ServedCall(status == "ok", message if isinstance(message, dict) else None))
    return served


async def _episodes_and_tool_errors(
    session: AsyncSession, policy: str, since: datetime
) -> tuple[dict[int | None, int], dict[int | None, list[bool]]]:
    """Episodes per version of their first call, and the outcomes of the tool calls of those episodes."""
    first = aliased(Call, name="first_call")
    on_first = and_(first.episode_id == Episode.id, first.position == 0)
    counted = await session.execute(
        select(first.adapter_version, func.count())
        .select_from(Episode)
        .join(first, on_first)
        .where(Episode.policy == policy, Episode.created_at >= since)
        .group_by(first.adapter_version)
    )
    episodes = {version: int(n) for version, n in counted}
    tools = await session.execute(
        select(first.adapter_version, func.count(), func.sum(case((ToolCall.is_error, 1), else_=0)))
        .select_from(ToolCall)
        .join(first, and_(first.episode_id == ToolCall.episode_id, first.position == 0))
        .where(ToolCall.policy == policy, ToolCall.created_at >= since)
        .group_by(first.adapter_version)
    )
    outcomes = {
        version: [True] * int(errors or 0) + [False] * (int(n) - int(errors or 0))
        for version, n, errors in tools
    }
    return episodes, outcomes


async def gather(session: AsyncSession, rollout: RolloutInfo, now: datetime | None = None) -> Evidence:
    """Both versions' evidence since the rollout started."""
    since = rollout.started_at if rollout.started_at.tzinfo else rollout.started_at.replace(tzinfo=UTC)
    rewards = await version_rewards(session, rollout.policy, since)
    episodes, tool_outcomes = await _episodes_and_tool_errors(session, rollout.policy, since)
    empty = RewardStats(0, None, None, None, None)
    arms = []
    for version in (rollout.version, rollout.baseline_version):
        health = LiveHealth.of(
            await _served(session, rollout.policy, version, since), tool_outcomes.get(version, ())
        )
        arms.append(Arm(version, rewards.get(version, empty), episodes.get(version, 0), health))
    paired = None
    if rollout.mode == "shadow":
        n, mean, variance = await paired_differences(session, rollout.id)
        paired = Paired(n, mean, variance)
    elapsed = ((now or datetime.now(UTC)) - since).total_seconds()
    return Evidence(arms[0], arms[1], elapsed, paired)


ENDING: dict[Decision, str] = {"promote": "promoted", "rollback": "rolled_back"}


async def apply(database: Database, rollout: RolloutInfo, verdict: Verdict, stats: dict[str, Any]) -> bool:
    """Record the look; end the rollout on a decision (False: another replica's monitor ended it first)."""
    async with database.session() as session:
        if verdict.decision == "continue":
            await record_evaluation(session, rollout.id, stats)
            await session.commit()
            return True
        try:
            await end_rollout(
                session, rollout.id, ENDING[verdict.decision], reason=verdict.reason, actor=ACTOR, stats=stats
            )
        except RolloutRefused:
            await session.rollback()
            return False
        if rollout.run_id is not None:
            outcome = {
                "id": rollout.id,
                "mode": rollout.mode,
                "status": ENDING[verdict.decision],
                "reason": verdict.reason,
            }
            await update_run(session, rollout.run_id, metrics_update={"rollout": outcome})
        await session.commit()
    logger.info(
        "%s of %s@%d: %s (%s)",
        rollout.mode,
        rollout.policy,
        rollout.version,
        ENDING[verdict.decision],
        verdict.reason,
    )
    return True


async def watch(
    database: Database,
    *,
    before_look: Callable[[RolloutInfo], Awaitable[None]] | None = None,
    now: datetime | None = None,
) -> list[tuple[RolloutInfo, Verdict]]:
    """One look at every running rollout, under the rollout section it started with (kept in its `config`).
    `before_look` runs first for each (the scheduler scores a shadow's new pairs there); its failure skips that
    rollout until the next look."""
    async with database.session() as session:
        rollouts = await running_rollouts(session)
    looked = []
    for rollout in rollouts:
        try:
            config = RolloutConfig.model_validate(rollout.config)
        except ValueError as exc:
            logger.warning("rollout %d has an invalid configuration, using the defaults: %s", rollout.id, exc)
            config = RolloutConfig()
        try:
            if before_look is not None:
                await before_look(rollout)
            async with database.session() as session:
                evidence = await gather(session, rollout, now)
        except Exception:
            logger.exception("could not read the evidence of rollout %d (%s)", rollout.id, rollout.policy)
            continue
        verdict = judge(rollout.mode, evidence, config)
        await apply(database, rollout, verdict, verdict.stats(evidence))
        looked.append((rollout, verdict))
    return looked
