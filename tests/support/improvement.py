"""Whether a trained version's mean reward beats another's by more than sampling explains.

A learning test compares mean rewards of sampled replies. A bare `after > before` passes on a lucky draw and fails
on an unlucky one: with 12 replies a side, one reply moves a mean by 0.083, and a barely trained candidate once
tied its base at 0.0833. The margin here follows from the sample sizes alone. Every reward these tests use lies in
[0, 1], so one reply's variance is at most 1/4, and the standard error of the difference of two means over n and m
replies is at most 0.5 * sqrt(1/n + 1/m), whatever the rewards are. A gain of `SIGMAS` such errors is one a
version no better than the other shows by chance about once in 700 draws (one-sided, normal approximation); where
both versions answer the same seeded draws, their rewards are positively correlated and the real error is
smaller still. The tests seed their sampling, so a rerun draws the same replies: a failure is reproducible, and
says that the gain was too small for its sample, not that the draw was unlucky.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

SIGMAS = 3.0


def chance_margin(n_before: int, n_after: int) -> float:
    """The smallest gain of a mean reward in [0, 1] that chance does not explain, for these sample sizes."""
    return SIGMAS * 0.5 * math.sqrt(1 / n_before + 1 / n_after)


def mean(rewards: Sequence[float]) -> float:
    return sum(rewards) / len(rewards)


def assert_improved(before: float, n_before: int, after: float, n_after: int) -> None:
    """`after` (a mean over `n_after` rewards in [0, 1]) beats `before` by more than `chance_margin`."""
    assert 0.0 <= before <= 1.0 and 0.0 <= after <= 1.0, (before, after)
    margin = chance_margin(n_before, n_after)
    assert after - before > margin, (
        f"mean reward {before:.3f} -> {after:.3f} over {n_before} and {n_after} replies: a gain of "
        f"{after - before:.3f}, not above the {margin:.3f} that chance explains"
    )


def assert_rewards_improved(before: Sequence[float], after: Sequence[float]) -> None:
    """The mean of `after`'s rewards beats the mean of `before`'s by more than `chance_margin`."""
    assert_improved(mean(before), len(before), mean(after), len(after))
