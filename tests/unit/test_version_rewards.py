"""The live-reward statistics of `storage.version_rewards` against numbers worked out by hand."""

from __future__ import annotations

import pytest

from storage.version_rewards import RewardStats, Z, difference


def stats_of(rewards: list[float]) -> RewardStats:
    """As SQL sums them: count, sum and sum of squares."""
    return RewardStats.of_sums(len(rewards), sum(rewards), sum(r * r for r in rewards))


def test_the_interval_is_the_normal_one_with_the_sample_deviation() -> None:
    assert round(Z, 6) == 1.959964
    # [0, 1, 1, 0]: mean 0.5, squared deviations 4 * 0.25 = 1 over n - 1 = 3, s = 0.577350,
    # half-width 1.959964 * 0.577350 / 2 = 0.565793.
    a = stats_of([0.0, 1.0, 1.0, 0.0])
    assert (a.episodes, a.mean) == (4, 0.5)
    assert a.std == pytest.approx(0.577350, abs=1e-6)
    assert (a.low, a.high) == pytest.approx((-0.065793, 1.065793), abs=1e-6)
    # [1, 1, 1, 0, 1]: mean 0.8, squared deviations 4 * 0.04 + 0.64 = 0.8 over 4, s = √0.2 = 0.447214,
    # half-width 1.959964 * 0.447214 / √5 = 1.959964 * 0.2 = 0.391993.
    b = stats_of([1.0, 1.0, 1.0, 0.0, 1.0])
    assert b.mean == pytest.approx(0.8)
    assert b.std == pytest.approx(0.447214, abs=1e-6)
    assert (b.low, b.high) == pytest.approx((0.408007, 1.191993), abs=1e-6)
    # Welch: √(1/3 / 4 + 0.2 / 5) = √0.123333 = 0.351188, half-width 0.688317: [-0.388317, 0.988317].
    d = difference(a, b)
    assert d.diff == pytest.approx(0.3)
    assert (d.low, d.high) == pytest.approx((-0.388317, 0.988317), abs=1e-6)
    assert not d.significant


def test_a_difference_whose_interval_excludes_zero_is_significant() -> None:
    # Both s = 0.1 over 3 episodes: √(0.01/3 * 2) = 0.081650, half-width 0.160030 around 0.6 (and around -0.6).
    low, high = stats_of([0.1, 0.2, 0.3]), stats_of([0.7, 0.8, 0.9])
    up = difference(low, high)
    assert up.diff == pytest.approx(0.6)
    assert (up.low, up.high) == pytest.approx((0.439970, 0.760030), abs=1e-6)
    assert up.significant
    down = difference(high, low)
    assert down.high == pytest.approx(-0.439970, abs=1e-6) and down.significant


def test_too_few_episodes_leave_the_interval_undefined() -> None:
    assert stats_of([]) == RewardStats(0, None, None, None, None)
    one = stats_of([0.7])
    assert (one.episodes, one.mean, one.std, one.low, one.high) == (1, 0.7, None, None, None)
    two = stats_of([0.2, 0.6])
    partial = difference(one, two)
    assert partial.diff == pytest.approx(-0.3) and (partial.low, partial.high, partial.significant) == (
        None,
        None,
        False,
    )
    nothing = difference(stats_of([]), two)
    assert (nothing.diff, nothing.significant) == (None, False)


def test_equal_rewards_have_no_spread() -> None:
    same = stats_of([0.3] * 10)
    # Summed in one pass (count, sum, sum of squares), so "no spread" is zero to within rounding.
    assert (
        same.std == pytest.approx(0.0, abs=1e-6)
        and same.low == pytest.approx(0.3)
        and same.high == pytest.approx(0.3)
    )
