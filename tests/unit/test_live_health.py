"""The canary's health guards: what counts as a refusal, an empty reply or a failed tool call, and when a
candidate's share is worse than the baseline's by more than its bound."""

from __future__ import annotations

import pytest

from trainer.control.live_health import HealthBounds, LiveHealth, ServedCall, health_problems, is_refusal


def answered(content: str | None, **message: object) -> ServedCall:
    return ServedCall(True, {"role": "assistant", "content": content, **message})


def test_refusals_are_the_field_or_the_opening_words() -> None:
    assert is_refusal({"content": None, "refusal": "I can't help with that."})
    for text in (
        "I'm sorry, but I can't do that.",
        "  Sorry, but I cannot",
        "I cannot answer.",
        "As an AI, I",
    ):
        assert is_refusal({"content": text}), text
    for text in ("Sorry to hear that! Paris is the capital.", "Paris.", "The AI said I can't", ""):
        assert not is_refusal({"content": text}), text


def test_signals_of_served_calls() -> None:
    calls = [
        answered("Paris."),
        answered(""),
        answered(None, tool_calls=[{"id": "c1"}]),  # a tool call is not an empty reply
        answered("I'm sorry, I can't."),
        ServedCall(False, None),
    ]
    health = LiveHealth.of(calls, [True, False, False, False])
    assert (health.calls, health.answered) == (5, 4)
    assert health.error_share == pytest.approx(1 / 5)
    assert health.empty_share == pytest.approx(1 / 4)
    assert health.refusal_share == pytest.approx(1 / 4)
    assert health.mean_length == pytest.approx((6 + 0 + 0 + 19) / 4)
    assert (health.tool_calls, health.tool_error_share) == (4, 0.25)
    nothing = LiveHealth.of([])
    assert (nothing.calls, nothing.empty_share, nothing.mean_length, nothing.tool_error_share) == (0, 0, 0, 0)


def health_of(empty: int, total: int, text: str = "Paris is the capital of France.") -> LiveHealth:
    return LiveHealth.of(
        [answered("") for _ in range(empty)] + [answered(text) for _ in range(total - empty)]
    )


def test_a_guard_trips_only_past_its_bound_at_the_low_end_of_the_interval() -> None:
    bounds = HealthBounds()
    baseline = health_of(2, 100)
    # 60% empty against 2%: far past the 0.1 bound even at the interval's low end.
    assert [
        p.split()[0] for p in health_problems(health_of(60, 100), baseline, bounds, alpha=0.05, min_calls=20)
    ] == ["empty_share"]
    # 15% against 2% is past the bound as a point, not at the interval's low end with 100 calls.
    assert health_problems(health_of(15, 100), baseline, bounds, alpha=0.05, min_calls=20) == []
    # Below min_calls nothing trips, however bad.
    assert health_problems(health_of(10, 10), baseline, bounds, alpha=0.05, min_calls=20) == []


def test_a_reply_length_collapse_trips_the_length_guard() -> None:
    baseline = health_of(0, 50)
    short = health_of(0, 50, text="Yes")
    problems = health_problems(short, baseline, HealthBounds(), alpha=0.05, min_calls=20)
    assert [p.split()[0] for p in problems] == ["mean_length"]
    assert health_problems(short, baseline, HealthBounds(length_ratio=0.05), alpha=0.05, min_calls=20) == []
