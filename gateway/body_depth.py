"""One nesting limit for the JSON a request carries, checked where the handler decodes its body.

The JSON decoders refuse a body nested deeper than the interpreter's recursion budget (about a thousand
levels), but a body just under that decodes and can then fail wherever it is handled again deeper in the
stack: an episode's metadata, a feedback item or a policy's configuration stored through the JSON columns'
encoder came out as a 500, and a refused policy left its adapter directory behind. Arrays or objects nested
deeper than `MAX_JSON_DEPTH` levels are refused with a 400 instead, so no schema check, template, encoder or
engine ever meets them; no client sends anything near it (OpenAI allows 10 levels of nesting in a
structured-output schema).

The check walks the value the handler decoded anyway, after the request was authenticated, so it costs no
second decode and nothing for a caller without a key. Its cost follows the number of arrays and objects, not
the bytes: 0.4 µs for a one-message chat body, 0.4 µs for one whose message is 1 MB of text, 67 µs for a
138 kB body with 30 tools (a bracket count of the bytes first, to skip the walk, cost 504 µs on the 1 MB one).
"""

from __future__ import annotations

from typing import Any

from gateway.errors import InvalidRequest

MAX_JSON_DEPTH = 128


def refuse_too_deep(value: Any, *, param: str | None = None) -> None:
    """400 `invalid_json` when `value` holds arrays or objects nested more than `MAX_JSON_DEPTH` levels deep."""
    if depth_exceeds(value, MAX_JSON_DEPTH):
        raise InvalidRequest(
            f"The JSON body is nested too deeply (more than {MAX_JSON_DEPTH} levels).",
            param=param,
            code="invalid_json",
        )


def depth_exceeds(value: Any, limit: int) -> bool:
    """Level by level (a recursive walk would meet the very limit it measures), stopping at the first level
    past `limit`; on the 30-tool body a walk that pushed (item, depth) pairs took about four times as long."""
    level: list[Any] = [value] if type(value) is dict or type(value) is list else []
    depth = 1
    while level:
        if depth > limit:
            return True
        below: list[Any] = []
        for item in level:
            for child in item.values() if type(item) is dict else item:
                kind = type(child)
                if kind is dict or kind is list:
                    below.append(child)
        level = below
        depth += 1
    return False
