import math

import pytest

from trainer.control.policy_config import SCALE_BY_STD_DEFAULT
from trainer.learner.advantages import group_advantages, has_signal


def test_mean_centred_by_default() -> None:
    # mean of (1, 0, 0, 1, 0.5) is 0.5
    assert group_advantages([1.0, 0.0, 0.0, 1.0, 0.5]) == pytest.approx([0.5, -0.5, -0.5, 0.5, 0.0])
    assert SCALE_BY_STD_DEFAULT is False


def test_advantages_sum_to_zero_and_keep_reward_units() -> None:
    rewards = [0.2, 0.9, 0.4]
    adv = group_advantages(rewards, scale_by_std=False)
    assert math.fsum(adv) == pytest.approx(0.0, abs=1e-12)
    # differences between attempts are the reward differences, unscaled
    assert adv[1] - adv[0] == pytest.approx(0.7)


def test_std_scaling_uses_population_std() -> None:
    # rewards (1, 0, 0, 1): mean 0.5, population std 0.5 -> advantages ±1
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], scale_by_std=True, eps=0.0)
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0])
    # (2, 4): mean 3, std 1 -> ±1 / (1 + eps)
    assert group_advantages([2.0, 4.0], scale_by_std=True, eps=0.25) == pytest.approx([-0.8, 0.8])


def test_std_scaling_amplifies_low_spread_groups_which_is_why_it_is_off() -> None:
    tiny = group_advantages([0.50, 0.51], scale_by_std=True, eps=0.0)
    assert tiny == pytest.approx([-1.0, 1.0])  # a 0.01 reward difference becomes a full unit
    assert group_advantages([0.50, 0.51]) == pytest.approx([-0.005, 0.005])


def test_zero_variance_group_gives_zeros_in_both_modes() -> None:
    assert group_advantages([0.7, 0.7, 0.7]) == pytest.approx([0.0, 0.0, 0.0])
    assert group_advantages([0.7, 0.7, 0.7], scale_by_std=True) == pytest.approx([0.0, 0.0, 0.0])


def test_empty_and_invalid() -> None:
    assert group_advantages([]) == []
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1.0, math.nan])
    with pytest.raises(ValueError, match="finite"):
        has_signal([math.inf, 0.0])


def test_has_signal() -> None:
    assert has_signal([0.0, 1.0])
    assert has_signal([0.5, 0.5, 0.6])
    assert not has_signal([0.5, 0.5, 0.5])
    assert not has_signal([0.5, 0.5 + 1e-9])
    assert not has_signal([1.0])
    assert not has_signal([])
    assert has_signal([0.5, 0.52], tolerance=0.01)
    assert not has_signal([0.5, 0.505], tolerance=0.01)
