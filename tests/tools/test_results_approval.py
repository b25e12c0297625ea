"""Tool results as messages (cut, named, errors as text), approvals and the step limit."""

from __future__ import annotations

from mcp.types import CallToolResult, EmbeddedResource, ImageContent, TextContent, TextResourceContents

from app.tools.approval import ApprovalPolicy, Decision, StepLimit
from app.tools.manager import ToolInfo
from app.tools.results import cut_text, error_result, from_call_result


def test_results() -> None:
    ok = from_call_result(CallToolResult(content=[TextContent(type="text", text="done")]), 100)
    assert ok.message("call_1", "fx__echo") == {"role": "tool", "tool_call_id": "call_1", "content": "done",
                                                "name": "fx__echo"}
    failed = from_call_result(CallToolResult(content=[TextContent(type="text", text="no such file")],
                                             is_error=True), 100)
    assert failed.is_error and failed.content == "Error: no such file"
    mixed = from_call_result(CallToolResult(content=[
        ImageContent(type="image", data="AAAA", mime_type="image/jpeg"),
        EmbeddedResource(type="resource", resource=TextResourceContents(uri="file:///a.txt", text="hello"))]), 100)
    assert mixed.content == "[image/jpeg image, 3 bytes: not shown]\n[resource file:///a.txt]\nhello"
    structured = from_call_result(CallToolResult(content=[], structured_content={"n": 1}), 100)
    assert structured.content == '{"n": 1}'
    assert error_result("timed out").content == "Error: timed out"


def test_cut_text_at_a_line_end() -> None:
    text = "".join(f"line {i}\n" for i in range(100))
    cut, was_cut = cut_text(text, 50)
    assert was_cut and cut.startswith("line 0\n") and cut.split("\n[output cut")[0].endswith("line 6")
    assert "more lines not shown" in cut
    assert cut_text("short", 50) == ("short", False)


def _tool(name: str, auto: bool = False) -> ToolInfo:
    return ToolInfo("s", name, f"s__{name}", "", {}, True, auto)


def test_approval() -> None:
    policy = ApprovalPolicy()
    read, edit = _tool("read", auto=True), _tool("edit")
    assert not policy.needs_asking(read) and policy.needs_asking(edit)
    assert policy.decide(edit, Decision.ONCE) and policy.needs_asking(edit)
    assert not policy.decide(edit, Decision.REFUSE) and policy.needs_asking(edit)
    assert policy.decide(edit, Decision.ALWAYS) and not policy.needs_asking(edit)
    assert ApprovalPolicy().needs_asking(edit)  # another chat asks again


def test_step_limit() -> None:
    steps = StepLimit(limit=2)
    assert steps.take() and steps.take() and not steps.take()
    assert "2 tool steps" in steps.message
    steps.reset()
    assert steps.take()
    assert StepLimit().limit == 8
