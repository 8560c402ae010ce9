"""Group-relative advantages for GRPO.

Every trajectory in a group answers the same task, so the group's own mean reward is the
baseline: an attempt is reinforced when it beat its siblings and discouraged when it fell short.
No value network is needed, which is what makes GRPO cheap enough to run next to a gateway.
"""

import math
from collections.abc import Sequence

from trainer.control.policy_config import SCALE_BY_STD_DEFAULT

#: Rewards closer together than this are treated as equal (judge scores are floats with noise).
SIGNAL_TOLERANCE = 1e-6


def _checked(rewards: Sequence[float]) -> list[float]:
    values = [float(r) for r in rewards]
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"rewards must be finite numbers, got {values!r}")
    return values


def group_advantages(
    rewards: Sequence[float], scale_by_std: bool = SCALE_BY_STD_DEFAULT, eps: float = 1e-6
) -> list[float]:
    """Return ``r_i - mean(r)`` for each reward, optionally divided by ``std(r) + eps``.

    The standard deviation is the population one (ddof=0): the group is all the attempts there
    are, not a sample of a larger population. ``eps`` keeps a zero-variance group at zero instead
    of dividing by zero. An empty group gives an empty list.
    """
    values = _checked(rewards)
    if not values:
        return []
    if min(values) == max(values):
        # Exact zeros: the float mean of equal values can differ from them by an ulp.
        return [0.0] * len(values)
    mean = math.fsum(values) / len(values)
    centred = [v - mean for v in values]
    if not scale_by_std:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / len(values))
    return [c / (std + eps) for c in centred]


def has_signal(rewards: Sequence[float], tolerance: float = SIGNAL_TOLERANCE) -> bool:
    """Say whether a group's rewards vary; a group where all attempts scored the same teaches nothing.

    Such groups have all-zero advantages, so they would only cost compute (and dilute the
    token-level mean of the loss); the trainer skips and counts them.
    """
    values = _checked(rewards)
    return len(values) >= 2 and max(values) - min(values) > tolerance
