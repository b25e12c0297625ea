"""MCP servers from the config TOML (Codex CLI's form) and from an mcp.json (Claude Desktop / Cursor)."""

from __future__ import annotations

import json
import tomllib

import pytest

from app.tools.config import BUILTIN_NAME, ToolsConfig, load_mcp_json, parse_mcp_json, parse_tools_config
from app.tools.errors import ToolConfigError

TOML = """
[tools]
max_result_chars = 4000
step_limit = 5

[mcp_servers.git]
command = "uvx"
args = ["mcp-server-git", "--repository", "."]
env = { GIT_PAGER = "cat" }
auto_approve = ["git_status"]
tool_timeout_sec = 20

[mcp_servers.web]
url = "http://127.0.0.1:9000/mcp"
enabled = false
"""


def test_toml_servers() -> None:
    config = parse_tools_config(tomllib.loads(TOML))
    git, web = config.servers
    assert (git.command, git.args, dict(git.env), git.auto_approve, git.call_timeout, git.transport) == (
        "uvx", ("mcp-server-git", "--repository", "."), {"GIT_PAGER": "cat"}, {"git_status"}, 20.0, "stdio")
    assert (web.url, web.enabled, web.transport) == ("http://127.0.0.1:9000/mcp", False, "http")
    assert (config.max_result_chars, config.step_limit, config.builtin) == (4000, 5, True)
    names = [s.name for s in config.all_servers("/tmp")]
    assert names == [BUILTIN_NAME, "git", "web"]
    builtin = config.all_servers("/tmp")[0]
    assert builtin.args[-3:] == ("mcp", "--root", "/tmp") and "read_file" in builtin.auto_approve
    assert [s.name for s in parse_tools_config({"tools": {"builtin": False}}).all_servers(".")] == []
    assert parse_tools_config({}) == ToolsConfig()


@pytest.mark.parametrize("data, message", [
    ({"mcp_servers": {"a": {"command": "x", "url": "http://h"}}}, "either command"),
    ({"mcp_servers": {"a": {}}}, "either command"),
    ({"mcp_servers": {"a": {"command": "x", "args": "y"}}}, "must be a list"),
    ({"mcp_servers": {"a": {"command": "x", "args": [1]}}}, "list of strings"),
    ({"mcp_servers": {"a": {"command": "x", "comand": "y"}}}, "unknown key mcp_servers.a.comand"),
    ({"mcp_servers": {"a b": {"command": "x"}}}, "server name"),
    ({"mcp_servers": {"a": {"url": "ftp://h"}}}, "http://"),
    ({"mcp_servers": {"a": "x"}}, "must be a table"),
    ({"tools": {"step_limit": 0}}, "positive"),
    ({"tools": {"builtin": "yes"}}, "must be a bool"),
])
def test_bad_toml_says_what(data, message) -> None:
    with pytest.raises(ToolConfigError, match=message) as e:
        parse_tools_config(data, "config.toml")
    assert "\n" not in str(e.value)


def test_mcp_json(tmp_path) -> None:
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {
        "fs": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "."],
               "autoApprove": ["read_file"], "disabled": True, "alwaysAllow": []},
        "remote": {"type": "http", "url": "https://example.com/mcp"}}}))
    fs, remote = load_mcp_json(path)
    assert (fs.command, fs.auto_approve, fs.enabled) == ("npx", {"read_file"}, False)
    assert remote.url == "https://example.com/mcp"
    with pytest.raises(ToolConfigError, match="twice"):
        ToolsConfig(servers=(fs,)).with_servers((fs,))
    with pytest.raises(ToolConfigError, match="does not exist"):
        load_mcp_json(tmp_path / "none.json")
    with pytest.raises(ToolConfigError, match="mcpServers"):
        parse_mcp_json({"servers": {}})
    with pytest.raises(ToolConfigError, match="only stdio"):
        parse_mcp_json({"mcpServers": {"s": {"type": "sse", "url": "http://h"}}})


def test_read_tools_config(tmp_path) -> None:
    from app.tools.config import read_tools_config

    toml = tmp_path / "config.toml"
    toml.write_text('model = "x"\n' + TOML)
    mcp = tmp_path / "mcp.json"
    mcp.write_text('{"mcpServers": {"fs": {"command": "npx"}}}')
    config = read_tools_config(toml, mcp)
    assert [s.name for s in config.servers] == ["git", "web", "fs"] and config.step_limit == 5
    assert read_tools_config(tmp_path / "none.toml") == ToolsConfig()
    toml.write_text("[mcp_servers.a]\ncommand = 1\n")
    with pytest.raises(ToolConfigError, match="mcp_servers.a.command"):
        read_tools_config(toml)
