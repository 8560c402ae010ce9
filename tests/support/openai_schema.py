"""Validate gateway output against OpenAI's own API description (shared/reference/openai-openapi.json)."""

from __future__ import annotations

import copy
import functools
import json
import os
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from referencing import Registry, Resource

_SPEC = Path("shared") / "reference" / "openai-openapi.json"
# OPENAI_OPENAPI_JSON names the file for a checkout that is not next to `shared/`; otherwise the nearest `shared/`
# above the checkout: /work/shared for /work/main and for worktrees under /work/wt.
SPEC_PATH = (
    Path(os.environ["OPENAI_OPENAPI_JSON"])
    if os.environ.get("OPENAI_OPENAPI_JSON")
    else next(
        (p / _SPEC for p in Path(__file__).resolve().parents if (p / _SPEC).is_file()),
        Path(__file__).resolve().parents[3] / _SPEC,
    )
)


def _json_schema(node: Any) -> Any:
    """OpenAPI's `nullable: true` is not JSON Schema: rewrite it as an explicit null alternative."""
    if isinstance(node, list):
        return [_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _json_schema(value) for key, value in node.items() if key != "nullable"}
    if node.get("nullable") is True:
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
        return {"anyOf": [out, {"type": "null"}]}
    return out


@functools.cache
def _registry() -> Registry:
    if not SPEC_PATH.is_file():
        raise FileNotFoundError(
            f"OpenAI's API description is not at {SPEC_PATH}: the tests read {_SPEC} from the nearest directory "
            "above the checkout that has it, so clone the repository next to that `shared/` directory or set "
            "OPENAI_OPENAPI_JSON to the file's path"
        )
    spec = _json_schema(copy.deepcopy(json.loads(SPEC_PATH.read_text())))
    return Registry().with_resource("openai", Resource.from_contents(spec, default_specification=_draft()))


def _draft() -> Any:
    from referencing.jsonschema import DRAFT202012

    return DRAFT202012


def validate(schema_name: str, instance: Any) -> None:
    """Raise `jsonschema.ValidationError` unless `instance` conforms to `components/schemas/<schema_name>`."""
    validator = Draft202012Validator(
        {"$ref": f"openai#/components/schemas/{schema_name}"}, registry=_registry()
    )
    validator.validate(instance)
