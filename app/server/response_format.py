"""What a request asks the output to be (`response_format`, vLLM's `structured_outputs` and
`guided_*`) as the engine's constraint fields of `SamplingParams` (`json_schema`, `json_object`,
`regex`, `grammar`, `structural_tag`). The engine compiles and enforces them; a schema it cannot
compile comes back as a `RequestError` naming the field, which the endpoint renames to the
request field the client sent (`Constraint.param`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from app.engine.types.errors import RequestError
from app.engine.types.sampling_params import SamplingParams
from app.server.openai_schema import SamplingRequest
from app.server.output_schema import ResponseFormat, StructuredOutputs

# The engine's names for the constraint kinds; at most one per request.
CONSTRAINT_FIELDS = ("json_schema", "json_object", "regex", "grammar", "structural_tag")


@dataclass(frozen=True)
class Constraint:
    """`fields`: SamplingParams keyword arguments (one constraint kind); `param`: the request field
    it came from, named in errors about it."""

    fields: dict[str, Any]
    param: str

    @property
    def json_schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must match ({"type": "object"} for json_object), if it is JSON."""
        if self.fields.get("json_object"):
            return {"type": "object"}
        schema = self.fields.get("json_schema")
        return load_schema(schema, self.param) if schema is not None else None

    def renames(self) -> dict[str, str]:
        """Engine field -> request field, for errors the engine raises about the constraint."""
        return {name: self.param for name in CONSTRAINT_FIELDS}


def load_schema(schema: dict[str, Any] | str, param: str) -> dict[str, Any]:
    """A schema given as a JSON string, parsed (the engine takes both; tool prompts need the object)."""
    if isinstance(schema, dict):
        return schema
    try:
        loaded = json.loads(schema)
    except ValueError as exc:
        raise RequestError(f"{param}: the schema is not valid JSON: {exc}", param=param) from None
    if not isinstance(loaded, dict):
        raise RequestError(f"{param}: the schema must be a JSON object", param=param)
    return loaded


def output_constraint(body: SamplingRequest) -> Constraint | None:
    """The one output constraint `body` asks for, or None for free text. Raises `RequestError`
    when it asks for more than one, or for a format without its schema."""
    given = [c for c in (_from_response_format(body.response_format),
                         _from_structured_outputs(body.structured_outputs), _from_guided(body)) if c is not None]
    if len(given) > 1:
        params = " and ".join(c.param for c in given)
        raise RequestError(f"{params} each constrain the output; send only one", param=given[1].param)
    return given[0] if given else None


def _from_response_format(fmt: ResponseFormat | None) -> Constraint | None:
    param = "response_format"
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        if fmt.schema_ is not None:
            return Constraint({"json_schema": fmt.schema_}, param)
        return Constraint({"json_object": True}, param)
    if fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise RequestError('response_format: type "json_schema" needs a "json_schema" object '
                               '({"name": ..., "schema": {...}})', param="response_format.json_schema")
        schema = fmt.json_schema.schema_
        # OpenAI's schema is optional; without one any JSON object will do.
        return Constraint({"json_schema": schema} if schema is not None else {"json_object": True}, param)
    if fmt.format is None:
        raise RequestError('response_format: type "structural_tag" needs a "format" object',
                           param="response_format.format")
    return Constraint({"structural_tag": {"type": "structural_tag", "format": fmt.format}}, param)


def _from_structured_outputs(outputs: StructuredOutputs | None) -> Constraint | None:
    if outputs is None:
        return None
    values = {"json_schema": outputs.json_, "json_object": outputs.json_object or None, "regex": outputs.regex,
              "grammar": outputs.grammar, "structural_tag": outputs.structural_tag,
              "grammar_choice": outputs.choice}
    given = {k: v for k, v in values.items() if v is not None}
    if len(given) > 1:
        raise RequestError("structured_outputs: give only one of json, json_object, regex, grammar, choice, "
                           "structural_tag", param="structured_outputs")
    return _constraint(given, "structured_outputs") if given else None


def _from_guided(body: SamplingRequest) -> Constraint | None:
    values = {"json_schema": (body.guided_json, "guided_json"), "regex": (body.guided_regex, "guided_regex"),
              "grammar": (body.guided_grammar, "guided_grammar"),
              "grammar_choice": (body.guided_choice, "guided_choice")}
    given = {k: v for k, v in values.items() if v[0] is not None}
    if len(given) > 1:
        names = " and ".join(param for _, param in given.values())
        raise RequestError(f"{names}: give only one guided_* field", param=next(iter(given.values()))[1])
    if not given:
        return None
    kind, (value, param) = next(iter(given.items()))
    return _constraint({kind: value}, param)


def _constraint(given: dict[str, Any], param: str) -> Constraint:
    kind, value = next(iter(given.items()))
    if kind == "grammar_choice":
        return Constraint({"grammar": choice_grammar(value, param)}, param)
    return Constraint({kind: value}, param)


def constrained_params(body: SamplingRequest, max_tokens: int | None, logprobs: int | None,
                       constraint: Constraint | None) -> SamplingParams:
    """`body.sampling_params` with the constraint's fields; an error about them names the request
    field the client sent (`response_format`, not the engine's `json_schema`)."""
    try:
        return body.sampling_params(max_tokens, logprobs, constraint.fields if constraint else None)
    except RequestError as exc:
        if constraint is None or exc.param not in CONSTRAINT_FIELDS:
            raise
        raise RequestError(str(exc), param=constraint.param) from None


def choice_grammar(choices: list[str], param: str) -> str:
    """An EBNF grammar (xgrammar's dialect) whose only sentences are `choices`."""
    if not choices:
        raise RequestError(f"{param}: give at least one choice", param=param)
    # JSON string escapes are also EBNF string-literal escapes.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=True) for c in choices)
