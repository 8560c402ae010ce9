"""The judge job: score a policy's unscored groups of episodes and store the scores as rewards.

Runs from `kaizen judge` and as a scheduler job. Groups are episodes of the policy that share a
`group_key`, else the same context up to the first assistant turn. A group is unscored while any of its
episodes lacks a score from the policy's scorer; RULER re-judges the whole group (its scores are relative).
One group failing is recorded (`judge_groups.status = failed`, with the error) and the batch goes on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from storage.database import Database
from storage.episodes import get_transcripts, scoring_candidates
from storage.rewards import NewReward, insert_rewards, record_judge_group
from trainer.control.rewards import policy_reward_config, refresh_episode_rewards
from trainer.control.ruler import Complete, JudgeSettings
from trainer.control.scoring import GroupScore, Scorer

log = logging.getLogger(__name__)


@dataclass
class JudgeReport:
    groups: int = 0  # groups attempted
    judged: int = 0
    failed: int = 0
    too_small: int = 0  # unscored groups with fewer episodes than the scorer needs
    in_progress: int = (
        0  # unscored groups left for later: an episode of theirs had a call after `settled_before`
    )
    rewards: int = 0  # reward rows written


async def unscored_groups(
    database: Database,
    policy: str,
    scorer: Scorer,
    since: datetime | None,
    settled_before: datetime | None = None,
) -> tuple[list[tuple[str, list[str]]], int, int]:
    """([(group, episode ids)], groups too small, groups in progress), oldest first. With `settled_before`, a group
    one of whose episodes had a call after it is in progress: an agent may still be adding turns, and a group is
    judged as a whole."""
    async with database.session() as session:
        candidates = await scoring_candidates(session, policy, source=scorer.source, since=since)
    groups: dict[str, list[tuple[str, bool]]] = {}
    busy: set[str] = set()
    for candidate in candidates:
        groups.setdefault(candidate.group, []).append((candidate.episode_id, candidate.scored))
        if settled_before is not None and candidate.last_call_at > settled_before:
            busy.add(candidate.group)
    ready: list[tuple[str, list[str]]] = []
    too_small = in_progress = 0
    for group, members in groups.items():
        if all(scored for _, scored in members):
            continue
        if len(members) < scorer.min_group_size:
            too_small += 1
            continue
        if group in busy:
            in_progress += 1
            continue
        if scorer.kind == "judge":
            ready.append((group, [episode_id for episode_id, _ in members]))
        else:
            ready.append((group, [episode_id for episode_id, scored in members if not scored]))
    return ready, too_small, in_progress


async def _store(
    database: Database, policy: str, group: str, episode_ids: list[str], result: GroupScore
) -> int:
    async with database.session() as session:
        group_id = await record_judge_group(
            session,
            policy=policy,
            group_key=group,
            episode_ids=episode_ids,
            scorer=result.source,
            model=result.model,
            status="judged" if result.scores is not None else "failed",
            attempts=result.attempts,
            error=result.error,
            latency_ms=result.latency_ms,
            cost_usd=result.cost_usd,
        )
        written = 0
        if result.scores is not None:
            share = len(result.scores)
            meta = {
                "judge_group_id": group_id,
                "group": group,
                "model": result.model,
                "latency_ms": result.latency_ms,
                "cost_usd": result.cost_usd / share if result.cost_usd is not None and share else None,
            }
            rows = [
                NewReward(
                    source=result.source,
                    name=result.name,
                    value=score.value,
                    episode_id=score.episode_id,
                    comment=score.explanation,
                    metadata=meta,
                    idempotency_key=f"{result.source}:{group_id}:{score.episode_id}",
                )
                for score in result.scores
            ]
            written = sum(inserted for _, inserted in await insert_rewards(session, rows))
            await refresh_episode_rewards(session, episode_ids)
        await session.commit()
    return written


async def judge_policy(
    database: Database,
    policy: str,
    judge: JudgeSettings,
    *,
    webhook_secret: str = "",
    since: datetime | None = None,
    settled_before: datetime | None = None,
    limit: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    complete: Complete | None = None,
) -> JudgeReport:
    """Score up to `limit` unscored groups of `policy`, `judge.concurrency` at a time; with `settled_before`, only
    groups whose episodes had no call after it."""
    async with database.session() as session:
        config = await policy_reward_config(session, policy)
    scorer = Scorer(config, judge, webhook_secret=webhook_secret, complete=complete)
    groups, too_small, in_progress = await unscored_groups(database, policy, scorer, since, settled_before)
    if limit is not None:
        groups = groups[:limit]
    report = JudgeReport(groups=len(groups), too_small=too_small, in_progress=in_progress)
    if progress is not None:
        progress(0, len(groups))
    gate = asyncio.Semaphore(judge.concurrency)
    done = 0

    async def run(group: str, episode_ids: list[str]) -> None:
        nonlocal done
        async with gate:
            try:
                async with database.session() as session:
                    found = await get_transcripts(session, episode_ids)
                trajectories = [found[e] for e in episode_ids if e in found]
                result = await scorer.score(trajectories)
                report.rewards += await _store(
                    database, policy, group, [t.episode_id for t in trajectories], result
                )
                if result.scores is None:
                    report.failed += 1
                    log.warning("group %s left unscored: %s", group, result.error)
                else:
                    report.judged += 1
            except Exception:  # a database hiccup on one group must not lose the others' work
                report.failed += 1
                log.exception("could not score group %s", group)
            done += 1
            if progress is not None:
                progress(done, len(groups))

    async with scorer:  # its judge's client, opened by the first group, is closed with the last
        await asyncio.gather(*(run(group, ids) for group, ids in groups))
    return report
