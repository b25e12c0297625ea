"""The output constraint of a request with tools: an xgrammar structural tag whose tags are the
calls `<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>`, ARGS constrained by the
function's `parameters` schema.

- "auto": free text until the model writes `<tool_call>`; from there the call must be complete
  and valid (a "triggered tag"), so a model may answer or call.
- "required": one or more calls and nothing else, back to back. No separator between them: a
  newline would be the likeliest token after `</tool_call>` and, allowed only as a separator,
  would commit a small model to another call (SmolLM2 then repeated calls until max_tokens);
  without it the model chooses between ending and another `<tool_call>`.
- A named function: exactly one call of it (as vLLM answers a named tool_choice).
- `parallel` false: the grammar ends after the first call.

The prefix up to the function name is part of each tag's `begin`, so the name is chosen from the
tool list and the arguments schema follows from it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.engine.text.tool_calls import CALL_END, CALL_OPEN, FunctionSpec, NamedChoice, ToolChoiceSpec, call_begin


def tool_structural_tag(tools: Sequence[FunctionSpec], choice: ToolChoiceSpec, parallel: bool,
                        answer_schema: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The structural tag for `choice` ("none": None). With `answer_schema` (a JSON response
    format next to tools under "auto"), the output is either calls or a JSON answer."""
    if choice == "none" or not tools:
        return None
    if isinstance(choice, NamedChoice):
        tools = [t for t in tools if t.name == choice.name]
        parallel = False
    tags = [_tag(t) for t in tools]
    if choice == "auto" and answer_schema is None:
        fmt: dict[str, Any] = {"type": "triggered_tags", "triggers": [CALL_OPEN],
                               "tags": tags, "at_least_one": False, "stop_after_first": not parallel}
    else:
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "", "at_least_one": True,
               "stop_after_first": not parallel}
        if answer_schema is not None and choice == "auto":
            fmt = {"type": "or", "elements": [fmt, {"type": "json_schema", "json_schema": answer_schema}]}
    return {"type": "structural_tag", "format": fmt}


def _tag(tool: FunctionSpec) -> dict[str, Any]:
    return {"type": "tag", "begin": call_begin(tool.name),
            "content": {"type": "json_schema", "json_schema": tool.parameters_schema}, "end": CALL_END}
