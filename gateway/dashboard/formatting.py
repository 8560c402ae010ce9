"""Jinja filters of the dashboard's templates: times, numbers and durations as people read them."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from storage.dashboard import message_text


def when(value: datetime | None) -> str:
    """A timestamp in UTC to the second."""
    if value is None:
        return "–"
    stamp = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    return stamp.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def number(value: Any, digits: int = 3) -> str:
    """A number with a few significant digits; integers as they are, with thousands separated."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return f"{int(value):,}"
        return f"{value:.{digits}g}"
    return str(value)


def duration(start: datetime | None, end: datetime | None) -> str:
    """How long something between two timestamps took."""
    if start is None or end is None:
        return "–"
    seconds = (end - start).total_seconds()
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


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
    "text": message_text,
    "metric": metric,
    "listing": listing,
}
