"""Scoring a shadow rollout's pairs with the policy's scorer, for the canary monitor's decision.

Each pair is scored as one group of two trajectories, the shared context followed by each reply: a reward
function or webhook scores each on its own, RULER judges both side by side on the same scale. Which reply comes
first alternates from pair to pair, so a judge that favours a position favours neither version. A pair the
scorer fails on is marked scored without rewards and left out of the comparison (`storage.shadows`).
"""

from __future__ import annotations

import asyncio
import logging

from storage.database import Database
from storage.episodes import EpisodeTranscript
from storage.rollouts import RolloutInfo
from storage.shadows import PairInfo, set_scores, unscored_pairs
from trainer.control.scoring import Scorer

log = logging.getLogger(__name__)

# Pairs scored at once: a judge is a remote model, and one pair at a time would make a monitor round slow.
_CONCURRENCY = 4


async def score_shadow_pairs(
    database: Database, rollout: RolloutInfo, scorer: Scorer, *, limit: int = 64
) -> int:
    """Score up to `limit` of the rollout's unscored pairs, oldest first; returns how many got both rewards."""
    async with database.session() as session:
        pairs = await unscored_pairs(session, rollout.id, limit)
    if not pairs:
        return 0
    slots = asyncio.Semaphore(_CONCURRENCY)

    async def score(pair: PairInfo) -> tuple[int, float | None, float | None]:
        async with slots:
            return await _score_pair(rollout, scorer, pair)

    scores = await asyncio.gather(*(score(pair) for pair in pairs))
    async with database.session() as session:
        await set_scores(session, scores)
        await session.commit()
    scored = sum(1 for _, served, shadow in scores if served is not None and shadow is not None)
    if scored < len(pairs):
        log.warning(
            "rollout %d: %d of %d shadow pairs could not be scored",
            rollout.id,
            len(pairs) - scored,
            len(pairs),
        )
    return scored


async def _score_pair(
    rollout: RolloutInfo, scorer: Scorer, pair: PairInfo
) -> tuple[int, float | None, float | None]:
    """(pair id, served reward, shadow reward); None where the scorer gave no score."""
    trajectories = {
        side: EpisodeTranscript(
            episode_id=f"shadow-{pair.id}-{side}",
            messages=[*pair.messages, reply],
            policy=rollout.policy,
        )
        for side, reply in (("served", pair.served), ("shadow", pair.shadow))
    }
    order = ["served", "shadow"] if pair.id % 2 else ["shadow", "served"]
    outcome = await scorer.score([trajectories[side] for side in order])
    if outcome.scores is None:
        log.warning("rollout %d: shadow pair %d not scored: %s", rollout.id, pair.id, outcome.error)
        return pair.id, None, None
    by_id = {score.episode_id: score.value for score in outcome.scores}
    return pair.id, by_id.get(trajectories["served"].episode_id), by_id.get(trajectories["shadow"].episode_id)
