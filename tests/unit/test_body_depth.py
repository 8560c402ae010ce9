"""`refuse_too_deep`, the nesting limit a decoded request body meets before it is handled."""

from __future__ import annotations

import json

import msgspec
import pytest

from gateway.body_depth import MAX_JSON_DEPTH, refuse_too_deep
from gateway.errors import InvalidRequest


def nested(depth: int, inner: str = "1") -> bytes:
    """An object holding arrays: `depth` containers in all, the outer object included."""
    return ('{"a": ' + "[" * (depth - 1) + inner + "]" * (depth - 1) + "}").encode()


@pytest.mark.parametrize(
    ("body", "deep"),
    [
        (nested(MAX_JSON_DEPTH), False),
        (nested(MAX_JSON_DEPTH + 1), True),
        (nested(500), True),  # decodable (in any test process), but past the limit
        (json.dumps({"content": "[" * 5000}).encode(), False),  # brackets inside a string are text
        (json.dumps({"items": [[1], {"b": [2]}] * 500}).encode(), False),  # many brackets, shallow
        (b'"a string"', False),
    ],
)
def test_only_bodies_nested_past_the_limit_are_refused(body: bytes, deep: bool) -> None:
    value = msgspec.json.decode(body)
    if deep:
        with pytest.raises(InvalidRequest) as refused:
            refuse_too_deep(value, param="metadata")
        assert (refused.value.code, refused.value.param) == ("invalid_json", "metadata")
    else:
        refuse_too_deep(value)
