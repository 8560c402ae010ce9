"""The hot-reload benchmark's window arithmetic, computed by hand: tokens count by time inside the window."""

from __future__ import annotations

import pytest

from tests.bench.bench_engine import Finished, window_stats


def test_tokens_count_in_proportion_to_the_time_inside_the_window() -> None:
    requests = [
        Finished(ended=10.0, seconds=10.0, tokens=100, error=None),  # ran 0..10: half of it inside 5..15
        Finished(ended=12.0, seconds=4.0, tokens=40, error=None),  # ran 8..12: all of it inside
        Finished(ended=14.0, seconds=1.0, tokens=0, error="ReadTimeout()"),  # failed inside: no tokens
        Finished(ended=30.0, seconds=5.0, tokens=50, error=None),  # ran 25..30: outside
    ]
    stats = window_stats(requests, 5.0, 15.0)
    assert stats["tok_s"] == pytest.approx((50 + 40) / 10)
    assert stats["requests"] == 3 and stats["errors"] == 1
    assert stats["request_median_s"] == pytest.approx(7.0)  # of the 10 s and 4 s requests that ended inside
    assert stats["request_max_s"] == pytest.approx(10.0)


def test_streams_finishing_in_waves_give_the_same_rate_in_every_window() -> None:
    # Two streams, each request 8 s long and 80 tokens, back to back from 0: the rate is 20 tokens/s throughout,
    # though one 12 s window sees one wave of ends (at 8) and the next sees two (at 16 and 24).
    requests = [
        Finished(ended=float(end), seconds=8.0, tokens=80, error=None)
        for end in (8, 16, 24)
        for _ in range(2)
    ]
    assert window_stats(requests, 0.0, 12.0)["tok_s"] == pytest.approx(20.0)
    assert window_stats(requests, 12.0, 24.0)["tok_s"] == pytest.approx(20.0)
