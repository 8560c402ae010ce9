"""Validate gateway output against OpenAI's own API description (shared/reference/openai-openapi.json)."""

from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator, ValidationError
from referencing import Registry, Resource

_SPEC = Path("shared") / "reference" / "openai-openapi.json"
_CHECKOUT = Path(__file__).resolve().parents[2]


def _spec_path() -> Path:
    """OPENAI_OPENAPI_JSON when set; else `shared/` in the nearest directory that has it above the checkout
    (/work/shared for /work/main and its worktrees) or, failing that, above the checkout a local clone was made
    from (`git clone . /tmp/x`); else where it would be next to the checkout, for the error to name."""
    named = os.environ.get("OPENAI_OPENAPI_JSON")
    if named:
        return Path(named)
    found = _nearest_spec(_CHECKOUT)
    if found is None and (origin := _cloned_from(_CHECKOUT)) is not None:
        found = _nearest_spec(origin)
    return found or _CHECKOUT.parent / _SPEC


def _nearest_spec(start: Path) -> Path | None:
    return next((d / _SPEC for d in (start, *start.parents) if (d / _SPEC).is_file()), None)


def _cloned_from(checkout: Path) -> Path | None:
    """The directory `origin` names when it is one on this machine (a local clone), else None."""
    try:
        url = subprocess.run(
            ["git", "-C", str(checkout), "config", "--get", "remote.origin.url"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:  # no git
        return None
    origin = Path(url.removeprefix("file://"))
    return origin.resolve() if url and origin.is_absolute() and origin.is_dir() else None


def _json_schema(node: Any, one_of: str = "oneOf") -> Any:
    """OpenAPI's `nullable: true` is not JSON Schema: rewrite it as an explicit null alternative. `one_of` is the
    keyword `oneOf` becomes."""
    if isinstance(node, list):
        return [_json_schema(item, one_of) for item in node]
    if not isinstance(node, dict):
        return node
    out = {
        (one_of if key == "oneOf" else key): _json_schema(value, one_of)
        for key, value in node.items()
        if key != "nullable"
    }
    if node.get("nullable") is True:
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
        return {"anyOf": [out, {"type": "null"}]}
    return out


@functools.cache
def _registry(one_of: str = "oneOf") -> Registry:
    path = _spec_path()
    if not path.is_file():
        raise FileNotFoundError(
            f"OpenAI's API description is not at {path}: the tests read {_SPEC} from the nearest directory above "
            "the checkout (or above the one it was cloned from) that has it, so clone the repository next to that "
            "`shared/` directory or set OPENAI_OPENAPI_JSON to the file's path"
        )
    spec = _json_schema(copy.deepcopy(json.loads(path.read_text())), one_of)
    return Registry().with_resource("openai", Resource.from_contents(spec, default_specification=_draft()))


def _draft() -> Any:
    from referencing.jsonschema import DRAFT202012

    return DRAFT202012


def _validator(schema_name: str, one_of: str = "oneOf") -> Draft202012Validator:
    return Draft202012Validator(
        {"$ref": f"openai#/components/schemas/{schema_name}"}, registry=_registry(one_of)
    )


def validate(schema_name: str, instance: Any) -> None:
    """Raise `jsonschema.ValidationError` unless `instance` conforms to `components/schemas/<schema_name>`."""
    _validator(schema_name).validate(instance)


def request_errors(schema_name: str, instance: Any) -> list[ValidationError]:
    """Every way a request departs from `components/schemas/<schema_name>` (empty when it conforms). Some of the
    spec's request alternatives overlap (a Responses input message `{"role": "user", "content": [...]}` is both an
    `EasyInputMessage` and an `InputMessage`), so `oneOf` is read as `anyOf`: matching two is not an error."""
    return list(_validator(schema_name, "anyOf").iter_errors(instance))
