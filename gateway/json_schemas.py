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
from typing import Any

from jsonschema import Draft7Validator, Draft202012Validator, validators
from jsonschema.exceptions import best_match
from jsonschema.protocols import Validator

from gateway.errors import InvalidRequest

_DRAFTS: tuple[type[Validator], ...] = (Draft202012Validator, Draft7Validator)


def check_function_parameters(name: str, schema: dict[str, Any], param: str) -> None:
    """A function tool's `parameters` that are not a JSON Schema are the client's 400, at `param`."""
    problem = schema_problem(schema)
    if problem is not None:
        message = f"Invalid schema for function '{name}': {problem}"
        raise InvalidRequest(message, param=param, code="invalid_function_parameters")


def check_response_schema(name: str, schema: dict[str, Any], param: str) -> None:
    """A `json_schema` response format whose schema is not a JSON Schema is the client's 400, at `param`."""
    problem = schema_problem(schema)
    if problem is not None:
        message = f"Invalid schema for response format '{name}': {problem}"
        raise InvalidRequest(message, param=param, code="invalid_json_schema")


def schema_problem(schema: dict[str, Any]) -> str | None:
    """What makes `schema` not a JSON Schema (the first problem and where it is), or None when it is one."""
    try:
        return _problem(json.dumps(schema, sort_keys=True))
    except RecursionError:
        return "the schema is nested too deeply"


@functools.lru_cache(maxsize=512)
def _problem(text: str) -> str | None:
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
