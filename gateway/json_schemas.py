"""Checking the JSON Schemas a request carries (function parameters, response formats) before an engine sees them.

vLLM turns these schemas into a grammar; one that is not a JSON Schema at all (`"type": "x"`, `"required": [{}]`)
fails there with a message about the grammar ("Invalid grammar specification: 'triggers'") that names neither the
tool nor the field. Judged here against JSON Schema's own meta-schemas, the client gets a 400 that says where the
problem is. The check is lenient on drafts: a schema that names its draft in `$schema` is held to that draft, any
other one passes when either draft 2020-12 or draft 7 accepts it (tools written for either are common). Agents
send the same tools on every call, so verdicts are cached by the schema's text.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Literal

import msgspec
from jsonschema import Draft7Validator, Draft202012Validator, validators
from jsonschema.exceptions import best_match
from jsonschema.protocols import Validator

from gateway.errors import InvalidRequest

_DRAFTS: tuple[type[Validator], ...] = (Draft202012Validator, Draft7Validator)
SchemaOwner = Literal["function", "response format"]
_CODES: dict[SchemaOwner, str] = {
    "function": "invalid_function_parameters",
    "response format": "invalid_json_schema",
}


def check_schema(owner: SchemaOwner, name: str, schema: dict[str, Any], param: str) -> None:
    """A function's `parameters` or a response format's `schema` that is not a JSON Schema is the client's 400,
    at `param`."""
    problem = schema_problem(schema)
    if problem is not None:
        message = f"Invalid schema for {owner} '{name}': {problem}"
        raise InvalidRequest(message, param=param, code=_CODES[owner])


def schema_problem(schema: dict[str, Any]) -> str | None:
    """What makes `schema` (as decoded from a request body) not a JSON Schema, the first problem and where it
    is, or None when it is one. The cache key is the schema's JSON in the client's key order: a microsecond, where
    a sorted `json.dumps` takes eight per tool, and a Responses call is checked twice (as itself, then as the chat
    call it becomes)."""
    try:
        return _problem(msgspec.json.encode(schema))
    except RecursionError:
        return "the schema is nested too deeply"


@functools.lru_cache(maxsize=512)
def _problem(text: bytes) -> str | None:
    schema = json.loads(text)
    uri = schema.get("$schema")
    named = validators.validator_for(schema, default=None) if isinstance(uri, str) else None
    drafts = (named,) if named is not None else _DRAFTS
    first: str | None = None
    for draft in drafts:
        error = best_match(draft(draft.META_SCHEMA).iter_errors(schema))
        if error is None:
            return None
        if first is None:
            where = "/".join(str(step) for step in error.absolute_path)
            first = f"{_clip(error.message)} at `{where}`" if where else _clip(error.message)
    return first


def _clip(message: str, most: int = 200) -> str:
    return message if len(message) <= most else message[: most - 1] + "…"
