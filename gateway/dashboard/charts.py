"""Line charts as inline SVG, drawn on the server: no chart library, no script, nothing fetched by the browser.

A chart is a few series of (x, y) points on shared axes, plus vertical markers (promotions, rollbacks). Every
text that comes from data (series and marker labels) is escaped; colours come from the stylesheet by series
index (`series-0` ...), so the page's Content-Security-Policy needs no inline styles.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from markupsafe import Markup, escape

from gateway.dashboard.formatting import compact, number

WIDTH = 760
HEIGHT = 240
LEFT, RIGHT, TOP, BOTTOM = 56, 16, 24, 40
SERIES_CLASSES = 8  # the stylesheet colours series-0 .. series-7
FIT_SHARE = 0.5
"""Data that spans less than this share of a time window gets an x axis of its own span, not the window's."""
FIT_PAD = 0.1
"""The margin either side of data fitted so, as a share of its span (at least one bucket)."""
TIME_STEPS = (60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400, 172800, 604800)
"""Tick steps of a time axis, in seconds: whole minutes, hours and days, not 1000 s."""


@dataclass(frozen=True)
class Series:
    name: str
    points: Sequence[tuple[float, float]]  # (x, y), x ascending


@dataclass(frozen=True)
class Marker:
    x: float
    label: str
    kind: str = "promote"  # promote | rollback | gate: a CSS class


@dataclass(frozen=True)
class Axis:
    """How the x axis is labelled: times (Unix seconds) or plain numbers (run ids)."""

    label: Callable[[float], str]
    minimum: float | None = None
    maximum: float | None = None
    steps: Sequence[float] | None = None  # the tick steps it allows (None: 1, 2, 2.5, 5 times a power of ten)


@dataclass
class Chart:
    title: str
    series: list[Series]
    x_axis: Axis
    markers: list[Marker] = field(default_factory=list)
    y_label: str = ""
    y_min: float | None = None
    y_max: float | None = None
    y_format: Callable[[float], str] | None = None
    """How y values read, on the axis and at each point: a unit (`formatting.milliseconds`), or None for
    counts and scores (compact ticks such as 30k, points in full)."""


def time_axis(since: datetime, until: datetime, present: Iterable[float] = (), step: float = 0) -> Axis:
    """The window [since, until); or, where the data (`present`: x values, each the start of a `step`-second
    bucket, and any markers) spans under `FIT_SHARE` of it, that span and a margin, so that an hour of data in
    a day is the chart, not a sliver at its edge. Times read HH:MM within two days, else month-day."""
    low, high = since.timestamp(), until.timestamp()
    xs = list(present)
    if xs:
        first, last = min(xs), max(xs) + step
        if last - first < FIT_SHARE * (high - low):
            pad = max(step, FIT_PAD * (last - first), 60.0)
            low, high = max(low, first - pad), min(high, last + pad)
    pattern = "%H:%M" if high - low <= 2 * 86400 else "%m-%d"
    return Axis(lambda x: datetime.fromtimestamp(x, UTC).strftime(pattern), low, high, TIME_STEPS)


def number_axis() -> Axis:
    return Axis(number)


def _ticks(low: float, high: float, count: int = 5, steps: Sequence[float] | None = None) -> list[float]:
    """Round tick values spanning [low, high]: multiples of the first of `steps` (else of 1, 2, 2.5 or 5 times
    a power of ten) that makes at most about `count` of them."""
    if high <= low:
        return [low]
    raw = (high - low) / count
    if steps is not None and raw <= steps[-1]:
        step = next(s for s in steps if s >= raw)
    else:
        magnitude = 10 ** math.floor(math.log10(raw))
        step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step) + 1)]


def render(chart: Chart, *, caption: bool = True) -> Markup:
    """The chart as an `<svg>` element with a legend (after a `<figcaption>` of its title unless `caption` is
    off), safe to embed in a page."""
    xs = [x for s in chart.series for x, _ in s.points] + [m.x for m in chart.markers]
    ys = [y for s in chart.series for _, y in s.points]
    x_low = chart.x_axis.minimum if chart.x_axis.minimum is not None else min(xs, default=0.0)
    x_high = chart.x_axis.maximum if chart.x_axis.maximum is not None else max(xs, default=1.0)
    if x_high <= x_low:
        x_low, x_high = x_low - 1, x_high + 1
    y_low = chart.y_min if chart.y_min is not None else min([*ys, 0.0])
    y_high = chart.y_max if chart.y_max is not None else max(ys, default=1.0)
    if y_high <= y_low:
        y_high = y_low + 1
    inner_w, inner_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    tick_text = chart.y_format or compact
    value_text = chart.y_format or number

    def px(x: float) -> float:
        return LEFT + (x - x_low) / (x_high - x_low) * inner_w

    def py(y: float) -> float:
        return TOP + (1 - (y - y_low) / (y_high - y_low)) * inner_h

    parts = [f"<figcaption>{escape(chart.title)}</figcaption>"] if caption else []
    parts += [
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(chart.title)}">',
        f"<title>{escape(chart.title)}</title>",
    ]
    for tick in _ticks(y_low, y_high):
        y = py(tick)
        parts.append(f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>')
        parts.append(
            f'<text class="tick" x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{escape(tick_text(tick))}</text>'
        )
    for tick in _ticks(x_low, x_high, 6, chart.x_axis.steps):
        x = px(tick)
        parts.append(
            f'<text class="tick" x="{x:.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle">'
            f"{escape(chart.x_axis.label(tick))}</text>"
        )
    parts.append(
        f'<line class="axis" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{TOP + inner_h}" y2="{TOP + inner_h}"/>'
    )
    if chart.y_label:
        parts.append(f'<text class="axis-label" x="4" y="10">{escape(chart.y_label)}</text>')
    for marker in chart.markers:
        if not x_low <= marker.x <= x_high:  # outside a range fitted to the data
            continue
        x = px(marker.x)
        parts.append(
            f'<g class="marker marker-{escape(marker.kind)}"><title>{escape(marker.label)}</title>'
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{TOP + inner_h}"/>'
            f'<text x="{x + 3:.1f}" y="{TOP + 10}">{escape(marker.label)}</text></g>'
        )
    for index, series in enumerate(chart.series):
        css = f"series-{index % SERIES_CLASSES}"
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in series.points)
        parts.append(f'<g class="{css}">')
        if len(series.points) > 1:
            parts.append(f'<polyline points="{coords}"/>')
        for x, y in series.points:
            label = f"{series.name}: {value_text(y)} at {chart.x_axis.label(x)}"
            parts.append(
                f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5"><title>{escape(label)}</title></circle>'
            )
        parts.append("</g>")
    for index, series in enumerate(chart.series):
        x = LEFT + 130 * index
        parts.append(
            f'<g class="legend series-{index % SERIES_CLASSES}"><rect x="{x}" y="{HEIGHT - 14}" width="10" '
            f'height="10"/><text x="{x + 14}" y="{HEIGHT - 5}">{escape(series.name)}</text></g>'
        )
    if not any(s.points for s in chart.series):
        parts.append(
            f'<text class="empty" x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle">no data in this window</text>'
        )
    parts.append("</svg>")
    return Markup("".join(parts))
