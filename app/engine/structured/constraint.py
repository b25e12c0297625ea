"""A request's output constraint as a hashable value: which field set it and its canonical text.

Two requests with the same constraint share one compiled grammar, so the text is normalised here:
JSON specs are parsed and re-serialised compactly (key order kept: a schema's property order is
the order the properties are generated in), so a dict and its JSON text are the same key; schemas
also get `json_schema`'s workaround rewrites before they become keys.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from app.engine.structured.json_schema import (
    bounded_strings_as_patterns,
    cap_tag_whitespace,
)
from app.engine.types.errors import RequestError
from app.engine.types.sampling_params import SamplingParams


@dataclass(frozen=True)
class Constraint:
    field: str  # the SamplingParams field that holds it ("json_schema", "regex", ...)
    spec: str  # canonical JSON for json_schema / structural_tag, the text itself for regex / grammar


def constraint_of(params: SamplingParams) -> Constraint | None:
    """The request's constraint, or None when its output is free. Raises `RequestError` (with
    `param`) when a JSON spec is not valid JSON or not an object."""
    field = params.constraint_field
    if field is None:
        return None
    value = getattr(params, field)
    if field == "json_object":
        return Constraint(field, "")
    if field == "json_schema":
        return Constraint(field, _dump(bounded_strings_as_patterns(_load_object(value, field)), field))
    if field == "structural_tag":
        tag = cap_tag_whitespace(_current_structural_tag(_load_object(value, field)))
        return Constraint(field, _dump(bounded_strings_as_patterns(tag), field))
    return Constraint(field, value)


def _load_object(value: dict | str, field: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RequestError(f"{field} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                               param=field) from None
    if not isinstance(value, dict):
        raise RequestError(f"{field} must be a JSON object, not {type(value).__name__}", param=field)
    return value


def _dump(value: dict[str, Any], field: str) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:  # a dict holding sets, NaN, objects...
        raise RequestError(f"{field} cannot be written as JSON: {e}", param=field) from None


def _current_structural_tag(tag: dict[str, Any]) -> dict[str, Any]:
    """vLLM's first structural-tag form ({"structures": [{"begin", "schema", "end"}], "triggers"})
    rewritten as the triggered_tags format that xgrammar compiles; the current form is returned
    unchanged."""
    if "structures" not in tag:
        return tag
    structures, triggers = tag.get("structures"), tag.get("triggers")
    ok = (isinstance(structures, list) and isinstance(triggers, list)
          and all(isinstance(s, dict) and {"begin", "schema", "end"} <= s.keys() for s in structures))
    if not ok:
        raise RequestError('structural_tag: "structures" must be a list of {"begin", "schema", "end"} objects '
                           'and "triggers" a list of strings', param="structural_tag")
    tags = [{"type": "tag", "begin": s["begin"], "end": s["end"],
             "content": {"type": "json_schema", "json_schema": s["schema"]}} for s in structures]
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}
