"""`localbatch mcp` through the MCP SDK's client: in-process, and as a real stdio subprocess."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from mcp import Client, StdioServerParameters

from app.engine.structured.tool_grammar import tool_structural_tag
from app.engine.text.tool_calls import FunctionSpec
from app.tools.builtin_server import build_server

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (tmp_path / "outside").mkdir()
    return tmp_path


async def test_tools_in_process(workdir: Path, tmp_path_factory) -> None:
    secret = tmp_path_factory.mktemp("secret") / "key.txt"
    secret.write_text("k\n")
    async with Client(build_server(workdir)) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert sorted(tools) == ["apply_edit", "list_files", "read_file", "search"]
        assert tools["read_file"].input_schema["required"] == ["path"]
        listed = await client.call_tool("list_files", {})
        assert listed.content[0].text == "calc.py\n(1 file)" and not listed.is_error
        edit = await client.call_tool("apply_edit", {"path": "calc.py", "search": "a - b", "replace": "a + b"})
        assert "+    return a + b" in edit.content[0].text
        assert (workdir / "calc.py").read_text().endswith("a + b\n")
        for path in (str(secret), f"../{secret.parent.name}/key.txt", "x\x00y"):
            refused = await client.call_tool("read_file", {"path": path})
            assert refused.is_error and "\n" not in refused.content[0].text
        bad = await client.call_tool("read_file", {"path": "calc.py", "start_line": 0})
        assert bad.is_error  # the schema's minimum


async def test_stdio_subprocess(workdir: Path) -> None:
    params = StdioServerParameters(command=sys.executable, args=["-m", "app.cli", "mcp", "--root", str(workdir)],
                                   cwd=str(ROOT), env={"PYTHONPATH": str(ROOT)})
    async with Client(params) as client:
        found = await client.call_tool("search", {"pattern": r"return a \- b", "context": 0})
        assert found.content[0].text.splitlines() == ["calc.py=1= def add(a, b):", "calc.py:2:     return a - b",
                                                       "(1 match in 1 file)"]
        escaped = await client.call_tool("apply_edit", {"path": "/etc/hostname", "search": "a", "replace": "b"})
        assert escaped.is_error and "absolute" in escaped.content[0].text


async def test_apply_edit_offers_its_two_forms(workdir: Path) -> None:
    """The schema says search + replace or diff (set on the SDK's tool: a change in the SDK shows
    here), so the call constraint writes one form: never both, nor a search without its replace."""
    xgr = pytest.importorskip("xgrammar")
    testing = pytest.importorskip("xgrammar.testing")
    async with Client(build_server(workdir)) as client:
        schema = {t.name: t for t in (await client.list_tools()).tools}["apply_edit"].input_schema
    assert [form["required"] for form in schema["anyOf"]] == [["path", "search", "replace"], ["path", "diff"]]
    tag = tool_structural_tag([FunctionSpec("files__apply_edit", None, schema)], "required", False)
    grammar = xgr.Grammar.from_structural_tag(json.dumps(tag))
    call = '<tool_call>\n{"name": "files__apply_edit", "arguments": ARGS}\n</tool_call>'
    for args, ok in [('{"path": "a.py", "search": "x", "replace": "y"}', True), ('{"path": "a.py", "diff": "d"}', True),
                     ('{"path": "a.py", "search": "x", "replace": "y", "diff": "d"}', False),
                     ('{"path": "a.py", "search": "x"}', False), ('{"path": "a.py"}', False)]:
        assert testing._is_grammar_accept_string(grammar, call.replace("ARGS", args)) is ok, args
