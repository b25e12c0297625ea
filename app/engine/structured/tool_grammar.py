"""The output constraint of a request with tools: an xgrammar structural tag whose tags are the
calls `<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>`, ARGS constrained by the
function's `parameters` schema.

- "auto": free text until the model writes `<tool_call>`; from there the call must be complete
  and valid (a "triggered tag"), so a model may answer or call. A reply that opens with a bare
  call object (`{"name": ...`, small models drop the tags; the parser takes it as a call) is held
  to the same rule, in a ```json fence or not: one of the branches below, chosen by the reply's
  first characters; such a reply ends with its call. Only the reply's opening counts: a
  `{"name": ...}` later in the text stays free.
- "required": one or more calls and nothing else, back to back. No separator between them: a
  newline would be the likeliest token after `</tool_call>` and, allowed only as a separator,
  would commit a small model to another call (SmolLM2 then repeated calls until max_tokens);
  without it the model chooses between ending and another `<tool_call>`.
- A named function: exactly one call of it (as vLLM answers a named tool_choice).
- `parallel` false: the grammar ends after the first call.

The prefix up to the function name is part of each tag's `begin`, so the name is chosen from the
tool list and the arguments schema follows from it."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from app.engine.text.tool_calls import (
    CALL_END,
    CALL_OPEN,
    FunctionSpec,
    NamedChoice,
    ToolChoiceSpec,
    call_begin,
)

# What follows a bare call's `{` up to its arguments (the tag's begin: the name picks the schema).
_BARE_KEY = '"name"'
_SPACE = r"\s"
_FENCE = r"```(json)?\s*"  # a Markdown code fence a bare call object may come in
# A reply that opens with a bare call object is that call: after it, only its fence's close (free
# text there let the 0.5B write the same call again and again until its token cap).
_BARE_END = {"type": "regex", "pattern": r"\s*(```\s*)?"}


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
        return {"type": "structural_tag", "format": _auto(tools, tags, parallel)}
    fmt: dict[str, Any] = _calls(tags, parallel)
    if answer_schema is not None and choice == "auto":
        fmt = {"type": "or", "elements": [fmt, {"type": "json_schema", "json_schema": answer_schema}]}
    return {"type": "structural_tag", "format": fmt}


def _auto(tools: Sequence[FunctionSpec], tags: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """Text and calls, by how the reply opens (leading whitespace aside): with `<tool_call>`, a
    tagged call; with `{` then `"name"` (in a ```` ```json ```` fence or not), a bare call object
    of an offered tool, which ends the reply; otherwise text. The tagged and text branches go on as
    free text in which `<tool_call>` opens a checked call."""
    free = {"type": "triggered_tags", "triggers": [CALL_OPEN], "tags": tags, "at_least_one": False,
            "stop_after_first": not parallel}
    bare, doubled = ({"type": "or", "elements": [_bare_call(t, braces) for t in tools]} for braces in (1, 2))
    return {"type": "or", "elements": [
        {"type": "sequence", "elements": [{"type": "regex", "pattern": r"\s*"}, _calls(tags, parallel), free]},
        {"type": "sequence", "elements": [{"type": "regex", "pattern": rf"\s*({_FENCE})?\{{\s*"}, bare, _BARE_END]},
        {"type": "sequence", "elements": [{"type": "regex", "pattern": rf"\s*({_FENCE})?\{{\s*\{{\s*"}, doubled,
                                          _BARE_END]},
        {"type": "sequence", "elements": [{"type": "regex", "pattern": _text_opening()}, free]},
    ]}


def _bare_call(tool: FunctionSpec, braces: int) -> dict[str, Any]:
    """A bare call object's rest after its opening brace(s), spaced as the model likes (a model
    that writes it over several lines, forced onto one, loses its way after the call). Doubled
    braces: Qwen's template shows the call format as `{{"name": ...}}`, and small models copy it,
    closing it with a brace more at times (taken as part of the call, not left as a reply's text)."""
    name = re.escape(json.dumps(tool.name))
    return {"type": "sequence", "elements": [
        {"type": "regex", "pattern": rf'{_BARE_KEY}\s*:\s*{name}\s*,\s*"arguments"\s*:\s*'},
        {"type": "json_schema", "json_schema": tool.parameters_schema},
        {"type": "regex", "pattern": r"\s*\}" if braces == 1 else r"\s*\}\s*\}(\s*\})?"},
    ]}


def _text_opening() -> str:
    """A regex for the opening of a reply that is neither a tagged call nor a bare call object."""
    # `{` (or `{{`) and then not `"name"`
    not_object = rf"\{{\s*({_differs_from(_BARE_KEY, _SPACE + '{')}|\{{\s*{_differs_from(_BARE_KEY, _SPACE)})"
    fence = [
        f"`{_differs_from('``')}",  # inline code, not a fence
        r"```[^\s{j`]",  # a fence of another language
        f"```j{_differs_from('son')}",
        r"```(json)?\s+[^\s{]",  # a fence whose first line is not an object
        r"```json[^\s{]",
        rf"```(json)?\s*{not_object}",
    ]
    return rf"\s*([^\s{{<`]|<{_differs_from(CALL_OPEN[1:])}|{not_object}|{'|'.join(fence)})"


def _differs_from(word: str, also: str = "") -> str:
    """A regex for text that leaves `word` somewhere inside it: `word[:i]`, then a character that
    is not `word[i]` (nor one of `also`, a character class's contents, at i = 0)."""
    alternatives = [re.escape(word[:i]) + f"[^{re.escape(word[i])}{also if i == 0 else ''}]" for i in range(len(word))]
    return f"({'|'.join(alternatives)})"


def _calls(tags: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    return {"type": "tags_with_separator", "tags": tags, "separator": "", "at_least_one": True,
            "stop_after_first": not parallel}


def _tag(tool: FunctionSpec) -> dict[str, Any]:
    return {"type": "tag", "begin": call_begin(tool.name),
            "content": {"type": "json_schema", "json_schema": tool.parameters_schema}, "end": CALL_END}
