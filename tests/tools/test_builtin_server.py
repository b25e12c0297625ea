"""`localbatch mcp` through the MCP SDK's client: in-process, and as a real stdio subprocess."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from mcp import Client, StdioServerParameters

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
        assert listed.content[0].text == "calc.py" and not listed.is_error
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
        assert found.content[0].text == "calc.py:2:     return a - b"
        escaped = await client.call_tool("apply_edit", {"path": "/etc/hostname", "search": "a", "replace": "b"})
        assert escaped.is_error and "absolute" in escaped.content[0].text
