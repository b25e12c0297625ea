"""Which MCP servers the app starts, from the config TOML (Codex CLI's form) or from a Claude
Desktop / Cursor `mcp.json`.

    [tools]                              # every key optional
    builtin = true                       # start `localbatch mcp` for the working directory
    max_result_chars = 16000             # longer tool results are cut, with a note
    step_limit = 8                       # tool calls in a row before the chat stops the loop
    call_timeout = 60                    # seconds a call may take (a server's tool_timeout_sec wins)

    [mcp_servers.NAME]
    command = "python3"                  # a stdio server: command, args, env, cwd
    args = ["server.py"]
    env = { KEY = "value" }
    # url = "http://127.0.0.1:9000/mcp"  # or a streamable-HTTP server
    auto_approve = ["read_file"]         # tools that run without asking
    enabled = true
    startup_timeout_sec = 10
    tool_timeout_sec = 60

`mcp.json`: `{"mcpServers": {"NAME": {"command", "args", "env", "cwd"} | {"url"}}}`, with the
same optional `autoApprove` / `auto_approve`, `disabled` and `enabled` keys."""

from __future__ import annotations

import json
import re
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from app.tools.errors import ToolConfigError

BUILTIN_NAME = "files"  # the built-in server's name; its tools are offered as files__read_file, ...
SERVER_NAME = re.compile(r"^[A-Za-z0-9_-]{1,32}$")
DEFAULT_STARTUP_TIMEOUT = 10.0
DEFAULT_CALL_TIMEOUT = 60.0
DEFAULT_RESULT_CHARS = 16_000
DEFAULT_STEP_LIMIT = 8


@dataclass(frozen=True)
class ServerConfig:
    """One MCP server: stdio (`command`) or streamable HTTP (`url`)."""

    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    cwd: str | None = None
    url: str | None = None
    auto_approve: frozenset[str] = frozenset()
    enabled: bool = True
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT
    call_timeout: float | None = None  # None: the `[tools]` call_timeout
    root: str | None = None  # the built-in server's working directory (`localbatch mcp --root`); None: another

    @property
    def transport(self) -> str:
        return "http" if self.url else "stdio"

    def describe(self) -> str:
        """The command line or URL, as the tools view shows it."""
        return self.url or " ".join([self.command or "", *self.args])


@dataclass(frozen=True)
class ToolsConfig:
    servers: tuple[ServerConfig, ...] = ()
    builtin: bool = True
    max_result_chars: int = DEFAULT_RESULT_CHARS
    step_limit: int = DEFAULT_STEP_LIMIT
    call_timeout: float = DEFAULT_CALL_TIMEOUT

    def with_servers(self, extra: tuple[ServerConfig, ...]) -> ToolsConfig:
        """These servers added (an `mcp.json`'s); a name given twice is an error."""
        names = {s.name for s in self.servers}
        for server in extra:
            if server.name in names:
                raise ToolConfigError(f"MCP server {server.name!r} is configured twice")
        return replace(self, servers=self.servers + extra)

    def all_servers(self, workdir: str | Path) -> tuple[ServerConfig, ...]:
        """The servers to start: the built-in one for `workdir` first (unless turned off)."""
        if not self.builtin or any(s.name == BUILTIN_NAME for s in self.servers):
            return self.servers
        return (builtin_server(workdir), *self.servers)


def builtin_server(workdir: str | Path) -> ServerConfig:
    """`localbatch mcp` for `workdir`, run by this Python from the package the app runs (`-P` and
    PYTHONPATH: a folder named app/ in the working directory is not imported); its read-only
    tools run without asking."""
    package_root = Path(__file__).resolve().parents[2]
    root = str(Path(workdir).expanduser().resolve())
    return ServerConfig(BUILTIN_NAME, command=sys.executable, args=("-P", "-m", "app.cli", "mcp", "--root", root),
                        env=MappingProxyType({"PYTHONPATH": str(package_root)}),
                        auto_approve=frozenset({"list_files", "read_file", "search"}), root=root)


# --- the config TOML ------------------------------------------------------------------------------

_TOOLS_KEYS = MappingProxyType({"builtin": bool, "max_result_chars": int, "step_limit": int,
                                "call_timeout": (int, float)})
_SERVER_KEYS = MappingProxyType({"command": str, "args": list, "env": dict, "cwd": str, "url": str,
                                 "auto_approve": list, "enabled": bool, "startup_timeout_sec": (int, float),
                                 "tool_timeout_sec": (int, float)})
TOML_TABLES = ("tools", "mcp_servers")  # the config's top-level tables this module reads


def parse_tools_config(data: Mapping[str, Any], where: str = "config") -> ToolsConfig:
    """The `[tools]` and `[mcp_servers.NAME]` tables of a parsed config TOML (other keys ignored)."""
    tools = _table(data.get("tools", {}), "[tools]", where)
    for key, value in tools.items():
        _check_type(key, value, _TOOLS_KEYS, "tools.", where)
    servers = _table(data.get("mcp_servers", {}), "[mcp_servers]", where)
    parsed = tuple(_toml_server(name, spec, where) for name, spec in servers.items())
    out = ToolsConfig(servers=parsed, builtin=tools.get("builtin", True),
                      max_result_chars=tools.get("max_result_chars", DEFAULT_RESULT_CHARS),
                      step_limit=tools.get("step_limit", DEFAULT_STEP_LIMIT),
                      call_timeout=float(tools.get("call_timeout", DEFAULT_CALL_TIMEOUT)))
    for key in ("max_result_chars", "step_limit", "call_timeout"):
        if getattr(out, key) <= 0:
            raise ToolConfigError(f"tools.{key} in {where} must be positive")
    return out


def _toml_server(name: str, spec: Any, where: str) -> ServerConfig:
    label = f"mcp_servers.{name}"
    spec = _table(spec, f"[{label}]", where)
    for key, value in spec.items():
        _check_type(key, value, _SERVER_KEYS, label + ".", where)
    return _server(name, spec, label, where)


# --- mcp.json -------------------------------------------------------------------------------------


def load_mcp_json(path: str | Path) -> tuple[ServerConfig, ...]:
    """The servers of a Claude Desktop / Cursor `mcp.json` (`--mcp-config FILE`)."""
    path = Path(path).expanduser()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ToolConfigError(f"MCP config {path} does not exist") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ToolConfigError(f"cannot read MCP config {path}: {e}") from None
    return parse_mcp_json(data, str(path))


def parse_mcp_json(data: Any, where: str = "mcp.json") -> tuple[ServerConfig, ...]:
    if not isinstance(data, dict) or not isinstance(data.get("mcpServers"), dict):
        raise ToolConfigError(f'{where} has no "mcpServers" object')
    out = []
    for name, spec in data["mcpServers"].items():
        label = f"mcpServers.{name}"
        if not isinstance(spec, dict):
            raise ToolConfigError(f"{label} in {where} must be an object")
        spec = dict(spec)
        if "autoApprove" in spec:
            spec["auto_approve"] = spec.pop("autoApprove")
        if "disabled" in spec:
            spec["enabled"] = not spec.pop("disabled")
        if "type" in spec and spec.pop("type") not in ("stdio", "http", "streamable-http", "streamableHttp"):
            raise ToolConfigError(f"{label} in {where}: only stdio and streamable-HTTP servers are supported")
        known = {k: v for k, v in spec.items() if k in _SERVER_KEYS}  # other clients' keys are ignored
        for key, value in known.items():
            _check_type(key, value, _SERVER_KEYS, label + ".", where)
        out.append(_server(name, known, label, where))
    return tuple(out)


# --- shared ---------------------------------------------------------------------------------------


def _server(name: str, spec: Mapping[str, Any], label: str, where: str) -> ServerConfig:
    if not SERVER_NAME.fullmatch(name):
        raise ToolConfigError(f"MCP server name {name!r} in {where}: use 1-32 letters, digits, '_' or '-'")
    command, url = spec.get("command"), spec.get("url")
    if (command is None) == (url is None):
        raise ToolConfigError(f"{label} in {where} needs either command (stdio) or url (streamable HTTP)")
    if url is not None and not re.match(r"^https?://", url):
        raise ToolConfigError(f"{label}.url in {where} must start with http:// or https://")
    args, env, approve = spec.get("args", []), spec.get("env", {}), spec.get("auto_approve", [])
    if not all(isinstance(a, str) for a in args):
        raise ToolConfigError(f"{label}.args in {where} must be a list of strings")
    if not all(isinstance(v, str) for v in env.values()):
        raise ToolConfigError(f"{label}.env in {where} must map names to strings")
    if not all(isinstance(a, str) for a in approve):
        raise ToolConfigError(f"{label}.auto_approve in {where} must be a list of tool names")
    for key in ("startup_timeout_sec", "tool_timeout_sec"):
        if key in spec and spec[key] <= 0:
            raise ToolConfigError(f"{label}.{key} in {where} must be positive")
    return ServerConfig(name=name, command=command, args=tuple(args), env=MappingProxyType(dict(env)),
                        cwd=str(Path(spec["cwd"]).expanduser()) if spec.get("cwd") else None, url=url,
                        auto_approve=frozenset(approve), enabled=spec.get("enabled", True),
                        startup_timeout=float(spec.get("startup_timeout_sec", DEFAULT_STARTUP_TIMEOUT)),
                        call_timeout=float(spec["tool_timeout_sec"]) if "tool_timeout_sec" in spec else None)


def _table(value: Any, label: str, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ToolConfigError(f"{label} in {where} must be a table")
    return value


def _check_type(key: str, value: Any, schema: Mapping[str, Any], prefix: str, where: str) -> None:
    if key not in schema:
        raise ToolConfigError(f"unknown key {prefix}{key} in {where}; known: {', '.join(sorted(schema))}")
    want = schema[key]
    if (isinstance(value, bool) and want is not bool) or not isinstance(value, want):
        kind = "number" if want == (int, float) else want.__name__
        raise ToolConfigError(f"{prefix}{key} in {where} must be a {kind}, got {value!r}")


def read_tools_config(config_path: str | Path | None, mcp_config: str | Path | None = None) -> ToolsConfig:
    """The tools settings of the app's config TOML at `config_path` (None or a missing file:
    defaults) plus the servers of an `mcp.json` (`--mcp-config`)."""
    config = ToolsConfig()
    path = Path(config_path).expanduser() if config_path is not None else None
    if path is not None and path.exists():
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise ToolConfigError(f"cannot read config {path}: {e}") from None
        config = parse_tools_config(data, str(path))
    if mcp_config is not None:
        config = config.with_servers(load_mcp_json(mcp_config))
    return config
