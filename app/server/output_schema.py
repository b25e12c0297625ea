"""Request fields that shape the output: `response_format`, vLLM's `structured_outputs`, `tools`,
`tool_choice` and `logit_bias` (pydantic models; what they become is decided in
`response_format` and `tool_prompt`).

Schemas themselves are checked by the engine's grammar compiler, not here: one compiler, one set
of messages."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
)

# Function names are written into prompts and grammars and parsed back out of the model's output:
# OpenAI's character set (plus '.', for namespaced tools) keeps them free of quotes and escapes.
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# OpenAI's range for a logit bias.
BIAS_LIMIT = 100.0
TOKEN_ID_MAX = 2**31 - 1


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


JsonSchema = dict[str, Any]


def object_or_string(value: Any) -> Any:
    # One message for both shapes (a plain union reports one error per alternative). ValueError,
    # not TypeError: pydantic turns only ValueError into a validation error (a 400).
    if not isinstance(value, (dict, str)):
        raise ValueError("must be a JSON object (or a string holding one)")  # noqa: TRY004
    return value


# A schema may also come as a JSON string (vLLM and llama-server accept both).
SchemaLike = Annotated[JsonSchema | str, BeforeValidator(object_or_string),
                       WithJsonSchema({"anyOf": [{"type": "object"}, {"type": "string"}]})]


class JsonSchemaFormat(_Body):
    """`response_format.json_schema`: OpenAI's `{name, schema, strict, description}`."""

    name: str | None = None
    description: str | None = None
    # `schema` would shadow a BaseModel attribute; the JSON name is `schema`.
    schema_: SchemaLike | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # llama-server's `{"type": "json_object", "schema": {...}}`.
    schema_: SchemaLike | None = Field(default=None, alias="schema")
    # xgrammar's structural tag: `{"type": "structural_tag", "format": {...}}`.
    format: dict[str, Any] | None = None


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs` (the successor of its `guided_*` fields); one of them at most."""

    json_: SchemaLike | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    structural_tag: SchemaLike | None = None


def _function_name(value: str) -> str:
    if not FUNCTION_NAME.fullmatch(value):
        raise ValueError(f"{value!r} is not a valid function name: use 1-64 letters, digits, '_', '-' or '.'")
    return value


FunctionName = Annotated[str, AfterValidator(_function_name)]


class FunctionDefinition(_Body):
    name: FunctionName
    description: str | None = None
    parameters: JsonSchema | None = None
    strict: bool | None = None

    @property
    def parameters_schema(self) -> JsonSchema:
        # A function without parameters still takes an (empty) arguments object.
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class ToolDefinition(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionRef(_Body):
    name: FunctionName


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionRef


ToolChoiceMode = Literal["none", "auto", "required"]
ToolChoice = ToolChoiceMode | NamedToolChoice
TOOL_CHOICE_MODES = ("none", "auto", "required")


def parse_tool_choice(value: Any) -> ToolChoice | None:
    """`"none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}`, with one
    message for every wrong shape (a plain union reports one error per alternative)."""
    if value is None or value in TOOL_CHOICE_MODES:
        return value  # type: ignore[no-any-return]
    if isinstance(value, dict) and value.get("type") == "function":
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if isinstance(name, str):
            return NamedToolChoice(type="function", function=FunctionRef(name=_function_name(name)))
    raise ValueError('must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')


def parse_logit_bias(value: Any) -> dict[int, float] | None:
    """OpenAI's `{"token id": bias}` (string keys, as JSON objects have) to `{id: bias}`."""
    if value is None:
        return None
    if not isinstance(value, dict):  # ValueError: see object_or_string
        raise ValueError(  # noqa: TRY004
            'must be an object mapping token ids to biases, e.g. {"50256": -100}')
    out: dict[int, float] = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and int(key) <= TOKEN_ID_MAX):
            raise ValueError(f"key {key!r} is not a token id (a non-negative integer in a string)")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise ValueError(f"the bias of token {key} must be a number, not {bias!r}")
        if not -BIAS_LIMIT <= bias <= BIAS_LIMIT:
            raise ValueError(f"the bias of token {key} is {bias}; it must be in [-100, 100]")
        out[int(key)] = float(bias)
    return out or None
