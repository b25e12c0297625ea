"""A round of calls: approval asked only where needed, "always" remembered, refusal told to the
model, bad arguments and unknown tools answered, the step limit stops the loop."""

from __future__ import annotations

import json

from app.engine.api.tool_use import ParsedCall
from app.tools.approval import REFUSED_TEXT, ApprovalPolicy, Decision, StepLimit
from app.tools.guidance import cut_call_cause
from app.tools.manager import ToolInfo
from app.tools.results import ToolResult
from app.tools.turn import ToolLoop, edit_preview

TOOLS = {t.offered_name: t for t in (ToolInfo("files", "read_file", "files__read_file", "", {}, True, True),
                                     ToolInfo("files", "apply_edit", "files__apply_edit", "", {}, True, False))}


class Runner:
    def __init__(self) -> None:
        self.ran: list[tuple[str, dict]] = []

    def find(self, offered: str) -> ToolInfo | None:
        return TOOLS.get(offered)

    async def call_async(self, offered, arguments, timeout=None) -> ToolResult:
        self.ran.append((offered, dict(arguments)))
        return ToolResult(f"ran {offered}")


def call(name: str, **arguments) -> ParsedCall:
    return ParsedCall(f"id_{name}", name, json.dumps(arguments))


async def test_round_of_calls() -> None:
    runner, asked = Runner(), []
    loop = ToolLoop(runner, ApprovalPolicy(), StepLimit(2))

    async def ask(card):
        asked.append(card)
        return Decision.REFUSE if len(asked) == 1 else Decision.ALWAYS

    edit = call("files__apply_edit", path="a.py", search="x = 1\n", replace="x = 2\n")
    out = await loop.run([call("files__read_file", path="a.py"), edit, ParsedCall("bad", "files__read_file", "{nope")],
                         ask)
    assert [m["content"] for m in out] == ["ran files__read_file", REFUSED_TEXT,
                                           "Error: the arguments are not a JSON object"]
    assert out[1] == {"role": "tool", "tool_call_id": "id_files__apply_edit", "content": REFUSED_TEXT,
                      "name": "files__apply_edit"}
    assert [c.title for c in asked] == ["files · apply_edit"]
    assert asked[0].diff == "--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"
    out = await loop.run([edit, edit, call("nope__x")], ask)  # "always" from the second ask on
    assert [m["content"] for m in out] == ["ran files__apply_edit"] * 2 + ["Error: there is no tool named 'nope__x'"]
    assert len(asked) == 2
    assert await loop.run([edit], ask) is None  # the third round in a row: over the step limit of 2
    loop.steps.reset()
    assert await loop.run([], ask) == []


def test_edit_preview() -> None:
    assert edit_preview({"diff": "@@ -1 +1 @@\n-a\n+b\n"}) == "@@ -1 +1 @@\n-a\n+b\n"
    assert edit_preview({"path": "x"}) is None


async def test_a_call_cut_by_the_token_limit_is_told_so() -> None:
    """The model reads the cause and the cap, not a JSON error; a cut call whose arguments are
    whole (only `}` and `</tool_call>` missing) runs."""
    runner = Runner()
    loop = ToolLoop(runner, ApprovalPolicy(), StepLimit(4))
    cause = cut_call_cause(256)
    cut = ParsedCall("c1", "files__read_file", '{"path": "a.p')
    out = await loop.run_one(cut, refuse_all, cause)
    assert out["content"] == "Error: the call was cut at the 256-token limit of a reply; write a shorter call"
    assert (await loop.run_one(cut, refuse_all))["content"] == "Error: the arguments are not a JSON object"
    whole = ParsedCall("c2", "files__read_file", '{"path": "a.py"}')
    assert (await loop.run_one(whole, refuse_all, cause))["content"] == "ran files__read_file"
    assert cut_call_cause(None) == "the call was cut at the end of the context"


async def refuse_all(card) -> Decision:
    return Decision.REFUSE
