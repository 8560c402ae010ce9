"""`too_deep`, the nesting limit every JSON body meets before a handler reads it."""

from __future__ import annotations

import json

import pytest

from gateway.body_depth import MAX_JSON_DEPTH, too_deep


def nested(depth: int, inner: str = "1") -> bytes:
    """An object holding arrays: `depth` containers in all, the outer object included."""
    return ('{"a": ' + "[" * (depth - 1) + inner + "]" * (depth - 1) + "}").encode()


@pytest.mark.parametrize(
    ("body", "deep"),
    [
        (nested(MAX_JSON_DEPTH), False),
        (nested(MAX_JSON_DEPTH + 1), True),
        (nested(960), True),  # decodable, but past the limit
        (b"[" * 100_000 + b"]" * 100_000, True),  # past what the decoder itself takes
        (json.dumps({"content": "[" * 5000}).encode(), False),  # brackets inside a string are text
        (json.dumps({"items": [[1], {"b": [2]}] * 500}).encode(), False),  # many brackets, shallow
        (b"[" * 500, False),  # not JSON: its handler says so in its own words
        (b"", False),
    ],
)
def test_only_bodies_nested_past_the_limit_are_too_deep(body: bytes, deep: bool) -> None:
    assert too_deep(body) is deep
