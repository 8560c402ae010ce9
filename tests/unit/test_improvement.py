"""The learning tests' margin: a gain of a mean reward counts only beyond what its sample sizes explain."""

from __future__ import annotations

import pytest

from tests.support.improvement import assert_improved, assert_rewards_improved, chance_margin


def test_the_margin_shrinks_with_the_square_root_of_the_samples() -> None:
    assert chance_margin(12, 12) == pytest.approx(0.612, abs=1e-3)
    assert chance_margin(24, 24) == pytest.approx(0.433, abs=1e-3)
    assert chance_margin(48, 48) == pytest.approx(0.306, abs=1e-3)
    assert chance_margin(48, 192) == pytest.approx(chance_margin(192, 48))


@pytest.mark.parametrize(
    ("before", "after", "n"),
    [
        (0.0833, 0.0833, 12),  # the tie that once failed the bootstrap test by chance
        (0.125, 0.5, 24),  # better, but by less than 24 replies a side can tell from chance
        (0.9, 0.1, 48),  # worse
    ],
)
def test_a_gain_that_chance_explains_fails(before: float, after: float, n: int) -> None:
    with pytest.raises(AssertionError, match="chance explains"):
        assert_improved(before, n, after, n)


def test_a_gain_beyond_chance_passes() -> None:
    assert_improved(0.125, 24, 0.75, 24)
    assert_rewards_improved([0.0, 0.5] * 24, [1.0, 0.5] * 24)  # 0.25 -> 0.75 over 48 replies a side


def test_a_mean_outside_the_reward_range_is_refused() -> None:
    with pytest.raises(AssertionError):
        assert_improved(0.0, 24, 1.5, 24)
