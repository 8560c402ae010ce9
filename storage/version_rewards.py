"""Live reward per version of a policy, with 95% confidence intervals, and the difference between two versions.

The unit is the episode, attributed as the dashboard's live-reward chart attributes it (`storage.rollups`):
an episode counts for the adapter version that served its first call, with its derived reward
(`episodes.reward`), whenever that reward arrived. A reward given days after the call still counts for the
version that served it, not for the one active when the reward came.

The intervals are normal ones: mean ± z·s/√n with the sample standard deviation s and z = 1.96 (the 97.5th
percentile of the standard normal). Rewards are bounded (usually [0, 1]), so the mean is close to normal from a
few dozen episodes on; with fewer the interval is a little narrow. The difference of two versions' means uses
Welch's standard error √(s_a²/n_a + s_b²/n_b) with the same z. With fewer than two rewarded episodes a
version's standard deviation, and so every interval involving it, is undefined (None).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime
from statistics import NormalDist
from typing import Any

from sqlalchemy import Select, and_, func, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import aliased

from storage.models import Call, Episode
from storage.policies import get_policy, list_adapters

CONFIDENCE = 0.95
Z = NormalDist().inv_cdf(0.5 + CONFIDENCE / 2)
"""1.959963…: the normal quantile of a two-sided 95% interval."""


@dataclass(frozen=True)
class RewardStats:
    """The rewarded episodes a version served: how many, their mean reward, its spread and 95% interval."""

    episodes: int
    mean: float | None  # None: no rewarded episode
    std: float | None  # sample standard deviation (n - 1); None below two episodes
    low: float | None  # the 95% interval of the mean; None below two episodes
    high: float | None

    @classmethod
    def of_sums(cls, n: int, total: float, squares: float) -> RewardStats:
        """From the count, sum and sum of squares of the rewards (what SQL adds up in one pass)."""
        if n == 0:
            return cls(0, None, None, None, None)
        mean = total / n
        if n < 2:
            return cls(n, mean, None, None, None)
        # max(0, …): rounding can leave a tiny negative sum of squared deviations when all rewards are equal.
        std = math.sqrt(max(0.0, squares - total * mean) / (n - 1))
        half = Z * std / math.sqrt(n)
        return cls(n, mean, std, mean - half, mean + half)


@dataclass(frozen=True)
class Difference:
    """Mean reward of b minus that of a, with Welch's 95% interval; `significant`: the interval excludes 0."""

    diff: float | None  # None: a version without rewarded episodes
    low: float | None  # None: a version below two rewarded episodes
    high: float | None
    significant: bool


def difference(a: RewardStats, b: RewardStats) -> Difference:
    """b - a. With both standard deviations 0 the interval is the point itself: certain, if naive."""
    if a.mean is None or b.mean is None:
        return Difference(None, None, None, False)
    diff = b.mean - a.mean
    if a.std is None or b.std is None:
        return Difference(diff, None, None, False)
    half = Z * math.sqrt(a.std**2 / a.episodes + b.std**2 / b.episodes)
    low, high = diff - half, diff + half
    return Difference(diff, low, high, low > 0 or high < 0)


def _sums(*keys: Any) -> Select[Any]:
    """Rewarded episodes summed per `keys` and the version of their first call (count, sum, sum of squares)."""
    first = aliased(Call, name="first_call")
    return (
        select(
            *keys,
            first.adapter_version,
            func.count(Episode.reward).label("n"),
            func.sum(Episode.reward).label("total"),
            func.sum(Episode.reward * Episode.reward).label("squares"),
        )
        .select_from(Episode)
        .outerjoin(first, and_(first.episode_id == Episode.id, first.position == 0))
        .where(Episode.reward.is_not(None))
        .group_by(*keys, first.adapter_version)
    )


async def version_rewards(
    session: AsyncSession, policy: str, since: datetime | None = None
) -> dict[int | None, RewardStats]:
    """Every serving version of the policy's rewarded episodes started at or after `since` (None: all time),
    keyed by version (None: the base model served the first call, or the episode has no call)."""
    query = _sums().where(Episode.policy == policy)
    if since is not None:  # a time without a zone is UTC's, as every stored time is
        query = query.where(Episode.created_at >= (since if since.tzinfo else since.replace(tzinfo=UTC)))
    return {
        row.adapter_version: RewardStats.of_sums(int(row.n), float(row.total), float(row.squares))
        for row in await session.execute(query)
    }


async def live_rewards(session: AsyncSession, since: datetime) -> dict[tuple[str, int | None], RewardStats]:
    """Every policy's rewarded episodes started at or after `since`, per policy and serving version: /metrics
    reads a recent window, so the read stays bounded by the traffic of that window (the created_at index)."""
    query = _sums(Episode.policy).where(Episode.policy.is_not(None), Episode.created_at >= since)
    return {
        (row.policy, row.adapter_version): RewardStats.of_sums(
            int(row.n), float(row.total), float(row.squares)
        )
        for row in await session.execute(query)
    }


@dataclass(frozen=True)
class VersionReward:
    """One version of a policy (None: the base model) with the live reward of the episodes it served."""

    version: int | None
    status: str | None  # the adapter's status; None for the base model
    stats: RewardStats


async def policy_version_rewards(
    session: AsyncSession, policy: str, since: datetime | None = None
) -> list[VersionReward] | None:
    """Every version of the policy, oldest first, those without rewarded episodes included, then any version
    that served rewarded episodes but is no longer stored, then the base model (None) if it served any.
    None: no such policy."""
    info = await get_policy(session, policy)
    if info is None:
        return None
    stats = await version_rewards(session, policy, since)
    empty = RewardStats(0, None, None, None, None)
    rows = [
        VersionReward(a.version, a.status, stats.pop(a.version, empty))
        for a in await list_adapters(session, info.id)
    ]
    gone = sorted(stats, key=lambda version: (version is None, version or 0))
    rows.extend(VersionReward(version, None, stats[version]) for version in gone)
    return rows


class UnknownVersion(LookupError):
    """A version the policy never had; `param` names which of the two compared it was."""

    def __init__(self, policy: str, version: int, param: str) -> None:
        super().__init__(f"policy {policy!r} has no version {version}")
        self.param = param


async def compare_version_rewards(
    session: AsyncSession, policy: str, a: int, b: int, since: datetime | None = None
) -> tuple[VersionReward, VersionReward, Difference] | None:
    """Versions `a` and `b` of the policy with their live reward, and b - a (None: no such policy); raises
    `UnknownVersion` for a version it never had."""
    rows = await policy_version_rewards(session, policy, since)
    if rows is None:
        return None
    by_version = {row.version: row for row in rows}
    for param, version in (("a", a), ("b", b)):
        if version not in by_version:
            raise UnknownVersion(policy, version, param)
    return by_version[a], by_version[b], difference(by_version[a].stats, by_version[b].stats)
