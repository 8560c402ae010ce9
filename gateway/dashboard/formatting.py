"""Jinja filters of the dashboard's templates: times, numbers and durations as people read them."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from storage.dashboard import message_text


def when(value: datetime | None) -> str:
    """A timestamp in UTC to the second."""
    if value is None:
        return "–"
    stamp = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    return stamp.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def number(value: Any, digits: int = 3) -> str:
    """A number with a few significant digits, never in scientific notation; from a thousand up, rounded to a
    whole number with its thousands separated."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value.is_integer() or abs(value) >= 1000:
            return f"{value:,.0f}"
        # Through Decimal: `g` would write 2e-05 where a person reads 0.00002.
        return format(Decimal(f"{value:.{digits}g}"), "f")
    return str(value)


def compact(value: float) -> str:
    """A number for an axis tick, where room is short: 30k, 2.5M, else as `number` writes it."""
    for threshold, size, suffix in ((1e9, 1e9, "G"), (1e6, 1e6, "M"), (1e4, 1e3, "k")):
        if abs(value) >= threshold:
            return f"{number(value / size)}{suffix}"
    return number(float(value))


def seconds(value: Any) -> str:
    """A duration in the unit that reads best: 450 ms, 1.7 s, 30 s, 2.5 min, 1.2 h."""
    if not _is_real(value):
        return number(value)
    size = abs(value)
    if size == 0:
        return "0 s"
    if size < 1:
        return f"{number(value * 1000)} ms"
    if size < 60:
        return f"{number(float(value))} s"
    if size < 3600:
        return f"{number(value / 60, 2)} min"
    return f"{number(value / 3600, 2)} h"


_SPAN_UNITS = (("d", 86400), ("h", 3600), ("min", 60), ("s", 1))


def span(value: Any) -> str:
    """A long duration in seconds to the second, in its two largest units: 4 min 12 s, 3 h 15 min, 2 d 4 h (the
    rest cut off); under a minute as `seconds` writes it. For waits where 3.2 h hides a quarter of an hour."""
    if not _is_real(value) or abs(value) < 60:
        return seconds(value)
    left = round(abs(value))
    parts: list[tuple[int, str]] = []
    for unit, size in _SPAN_UNITS:
        count, left = divmod(left, size)
        if count or parts:
            parts.append((count, unit))
        if len(parts) == 2:
            break
    words = " ".join(f"{count} {unit}" for count, unit in parts if count)
    return f"-{words}" if value < 0 else words


def milliseconds(value: Any) -> str:
    """A duration given in milliseconds (latencies), as `seconds` writes it."""
    return seconds(value / 1000 if _is_real(value) else value)


def duration(start: datetime | None, end: datetime | None) -> str:
    """How long something between two timestamps took."""
    if start is None or end is None:
        return "–"
    return seconds((end - start).total_seconds())


def unit_of(name: str) -> Callable[[Any], str] | None:
    """How a metric reads by its name: `*_ms` and `*_s` (not `*_per_s`) are durations; None: a plain number."""
    if name.endswith("_ms"):
        return milliseconds
    if name.endswith("_s") and not name.endswith("per_s"):
        return seconds
    return None


def measure(value: Any, name: str) -> str:
    """A metric as its name's unit says (`unit_of`)."""
    return (unit_of(name) or number)(value)


def _is_real(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def metric(value: Any, *path: str) -> Any:
    """A value inside nested metrics (`runs.metrics`, `adapters.metrics`), or None where any step is missing or
    not an object: runs of other modes and versions carry other keys, and a page must not fail on them."""
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def listing(value: Any) -> str:
    """A list as `a; b`, anything else as it is (a metric that is a string here and a list elsewhere)."""
    if value is None:
        return ""
    if isinstance(value, list):
        return "; ".join(str(item) for item in value)
    return str(value)


FILTERS: dict[str, Callable[..., Any]] = {
    "when": when,
    "number": number,
    "duration": duration,
    "seconds": seconds,
    "span": span,
    "milliseconds": milliseconds,
    "measure": measure,
    "text": message_text,
    "metric": metric,
    "listing": listing,
}
