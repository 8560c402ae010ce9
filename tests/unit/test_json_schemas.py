"""The JSON Schemas in a request are judged against JSON Schema's meta-schemas before an engine sees them."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import InvalidRequest
from gateway.json_schemas import check_schema, schema_problem

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.mark.parametrize(
    "schema",
    [
        {},
        WEATHER,
        {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "$defs": {"x": {"type": "integer"}}},
        {"type": "array", "prefixItems": [{"type": "string"}]},  # draft 2020-12
        {"type": "array", "items": [{"type": "string"}]},  # draft 7's tuple form
        {"type": "object", "x-vendor-keyword": [1, 2]},  # unknown keywords are allowed
        {
            "$schema": "http://json-schema.org/draft-04/schema#",
            "type": "number",
            "maximum": 9,
            "exclusiveMaximum": True,
        },
    ],
    ids=["empty", "weather", "ref", "prefix-items", "tuple-items", "unknown-keyword", "draft-04-named"],
)
def test_a_json_schema_of_any_common_draft_passes(schema: dict[str, Any]) -> None:
    assert schema_problem(schema) is None


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        ({"type": "x"}, "'x' is not valid under any of the given schemas at `type`"),
        ({"type": "object", "properties": 0}, "0 is not of type 'object' at `properties`"),
        ({"type": "object", "required": [{}]}, "{} is not of type 'string' at `required/0`"),
        ({"properties": {"q": {"type": "string", "minLength": -1}}}, "-1 is less than the minimum of 0"),
        ({"$schema": 5, "type": "nothing"}, "at `type`"),
        (
            {"$schema": "https://json-schema.org/draft/2020-12/schema", "items": [{}]},
            "[{}] is not of type 'object', 'boolean' at `items`",
        ),
    ],
    ids=["type", "properties", "required", "nested", "schema-not-a-string", "named-draft-holds"],
)
def test_what_is_not_a_json_schema_is_named_with_its_place(schema: dict[str, Any], expected: str) -> None:
    problem = schema_problem(schema)
    assert problem is not None and expected in problem


def test_a_long_value_is_clipped_and_a_deep_schema_refused_not_raised() -> None:
    problem = schema_problem({"type": "x" * 70_000})
    assert problem is not None and len(problem) < 300
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(5000):
        deep = {"properties": {"a": deep}}
    assert schema_problem(deep) == "the schema is nested too deeply"


def test_the_400s_name_the_tool_or_format_and_the_field() -> None:
    check_schema("function", "get_weather", WEATHER, "tools[0].function.parameters")
    with pytest.raises(InvalidRequest) as raised:
        check_schema("function", "get_weather", {"type": "x"}, "tools[0].function.parameters")
    error = raised.value
    assert (error.status_code, error.param, error.code) == (
        400,
        "tools[0].function.parameters",
        "invalid_function_parameters",
    )
    assert error.message.startswith("Invalid schema for function 'get_weather': ")
    with pytest.raises(InvalidRequest) as raised:
        check_schema("response format", "forecast", {"required": "city"}, "text.format.schema")
    assert (raised.value.param, raised.value.code) == ("text.format.schema", "invalid_json_schema")
    assert "response format 'forecast'" in raised.value.message
