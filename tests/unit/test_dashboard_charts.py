"""The dashboard's numbers as people read them (no `3e+04`, durations in their unit) and its charts' x range
(a short run fills the chart, not a sliver at the edge of the window)."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest

from gateway.dashboard.charts import Chart, Marker, Series, number_axis, render, time_axis
from gateway.dashboard.formatting import compact, milliseconds, number, seconds, span

SCIENTIFIC = re.compile(r"\d[eE][+-]?\d")


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (30_000, "30,000"),
        (30_000.0, "30,000"),
        (1234.5, "1,234"),  # rounded, with its thousands separated
        (0.123456, "0.123"),
        (2e-5, "0.00002"),
        (1.5e-7, "0.00000015"),
        (-45_678.9, "-45,679"),
        (3e20, "300,000,000,000,000,000,000"),
        (None, "–"),
        (True, "true"),
    ],
)
def test_numbers_are_never_printed_in_scientific_notation(value: object, text: str) -> None:
    assert number(value) == text


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0"),
        (2.5, "2.5"),
        (1500, "1,500"),
        (30_000, "30k"),
        (12_500, "12.5k"),
        (2_500_000, "2.5M"),
        (0.0012, "0.0012"),
    ],
)
def test_axis_ticks_are_compact(value: float, text: str) -> None:
    assert compact(value) == text


@pytest.mark.parametrize(
    ("ms", "text"),
    [
        (0, "0 s"),
        (450, "450 ms"),
        (0.5, "0.5 ms"),
        (1700, "1.7 s"),
        (30_000, "30 s"),
        (150_000, "2.5 min"),
        (4_320_000, "1.2 h"),
    ],
)
def test_durations_are_in_the_unit_a_person_reads(ms: float, text: str) -> None:
    assert milliseconds(ms) == text
    assert seconds(ms / 1000) == text


@pytest.mark.parametrize(
    ("s", "text"),
    [
        (0.45, "450 ms"),
        (42, "42 s"),
        (60, "1 min"),
        (252, "4 min 12 s"),
        (3600, "1 h"),
        (3661, "1 h 1 min"),  # the seconds cut off
        (11_700, "3 h 15 min"),
        (187_200, "2 d 4 h"),
        (-252, "-4 min 12 s"),
        (None, "–"),
    ],
)
def test_long_waits_read_in_their_two_largest_units(s: float | None, text: str) -> None:
    assert span(s) == text


def _ticks(svg: str) -> list[str]:
    return re.findall(r'<text class="tick"[^>]*>([^<]*)</text>', svg)


def test_a_latency_chart_labels_its_axis_and_points_with_durations() -> None:
    now = datetime(2026, 1, 1, 12, tzinfo=UTC)
    points = [(now.timestamp() + 60 * i, ms) for i, ms in enumerate((450.0, 1700.0, 30_000.0))]
    svg = render(
        Chart(
            "Latency",
            [Series("mean", points)],
            time_axis(now, now + timedelta(hours=1)),
            y_format=milliseconds,
        )
    )
    assert not SCIENTIFIC.search(svg), svg
    assert {"0 s", "10 s", "20 s", "30 s"} <= set(_ticks(svg))
    assert "mean: 1.7 s at 12:01" in svg and "mean: 450 ms at 12:00" in svg


def test_large_counts_label_the_axis_without_scientific_notation() -> None:
    svg = render(Chart("Calls", [Series("calls", [(1.0, 30_000.0), (2.0, 120_000.0)])], number_axis()))
    assert not SCIENTIFIC.search(svg), svg
    assert "100k" in _ticks(svg) and "calls: 120,000 at 2" in svg


def _x_ticks(svg: str) -> list[str]:
    return re.findall(r'<text class="tick" x="[^"]*" y="216" text-anchor="middle">([^<]*)</text>', svg)


def test_a_short_run_in_a_long_window_fills_the_chart() -> None:
    """23 minutes of data in a 24-hour window: the x axis spans the data and a little more, not the day."""
    until = datetime(2026, 1, 1, 18, tzinfo=UTC)
    start = until - timedelta(minutes=40)
    xs = [start.timestamp() + 60 * i for i in range(24)]
    axis = time_axis(until - timedelta(hours=24), until, present=xs, step=60)
    assert axis.minimum is not None and axis.maximum is not None
    assert xs[0] - 5 * 60 <= axis.minimum < xs[0]
    assert xs[-1] + 60 <= axis.maximum <= xs[-1] + 60 + 5 * 60
    svg = render(Chart("Calls", [Series("calls", [(x, 1.0) for x in xs])], axis))
    circles = [float(x) for x in re.findall(r'<circle cx="([^"]+)"', svg)]
    assert circles[-1] - circles[0] > 0.75 * (760 - 56 - 16)  # the points spread over the plot
    labels = _x_ticks(svg)
    assert len(labels) >= 3 and all(re.fullmatch(r"17:[0-5][05]", t) for t in labels), labels


def test_data_over_most_of_the_window_shows_the_whole_window() -> None:
    until = datetime(2026, 1, 1, 18, tzinfo=UTC)
    since = until - timedelta(hours=6)
    xs = [since.timestamp() + 600, until.timestamp() - 600]
    axis = time_axis(since, until, present=xs, step=300)
    assert (axis.minimum, axis.maximum) == (since.timestamp(), until.timestamp())
    assert time_axis(since, until).minimum == since.timestamp()  # no data: the window itself


def test_a_marker_outside_the_fitted_range_is_not_drawn_off_the_chart() -> None:
    until = datetime(2026, 1, 1, 18, tzinfo=UTC)
    xs = [until.timestamp() - 600, until.timestamp() - 300]
    axis = time_axis(until - timedelta(hours=24), until, present=xs, step=300)
    chart = Chart(
        "Reward",
        [Series("v1", [(x, 0.5) for x in xs])],
        axis,
        markers=[Marker(xs[0] - 7200, "old"), Marker(xs[1], "new")],
    )
    drawn = render(chart)
    assert "new" in drawn and "old" not in drawn  # the one inside the range is drawn
