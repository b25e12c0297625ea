"""The app's TOML config (default model, device, sampling defaults, keymap, theme) and where files live.

Example `config.toml` (every key optional):

    model = "~/models/qwen3-0.6b-q8_0.gguf"
    device = "cpu"
    theme = "textual-dark"
    system_prompt = "You are a helpful assistant."
    export_dir = "~/chats"
    context_overflow = "drop_oldest"   # or "stop": a message that outgrows the context is refused
    kv_disk_cache_dir = "~/kv"        # the KV disk tier (prefix-cache blocks kept across restarts)
    kv_disk_cache_bytes = 8589934592  # its budget (0: off); the command line's flags win

    [sampling]
    temperature = 0.7
    top_p = 0.95
    max_tokens = 512
    seed = 1234

    [keymap]          # binding id = keys (comma-separated alternatives)
    new_tab = "ctrl+t"
    broadcast = "ctrl+b,f9"

    [server]          # the embedded endpoint (`--serve`)
    host = "127.0.0.1"
    port = 8000

    [tools]           # and [mcp_servers.NAME]: MCP tools, read by app.tools.config (docs/tools.md)
    step_limit = 8
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import platformdirs

from app.engine.types.context_window import OVERFLOW_DROP_OLDEST, OVERFLOW_POLICIES, OVERFLOW_STOP
from app.engine.types.errors import LocalbatchError, RequestError
from app.engine.types.sampling_params import SamplingParams
from app.tools.config import TOML_TABLES as TOOLS_TABLES

APP_NAME = "localbatch"


class ConfigError(LocalbatchError):
    """The config file cannot be used (bad TOML, unknown key, wrong type)."""


@dataclass(frozen=True)
class ChatSettings:
    """The sampling settings a chat tab exposes; also the config's `[sampling]` defaults."""

    temperature: float = 0.7
    top_p: float = 0.95
    max_tokens: int = 512
    seed: int | None = None
    # JSON mode: replies are constrained to JSON, to `json_schema` (JSON text) when one is given;
    # people try prompts here before wiring them into code that sends `response_format`.
    json_mode: bool = False
    json_schema: str = ""
    # A message that would overflow the context: drop the oldest turns (the system prompt stays;
    # the reply says how many were left out) or stop and say so.
    context_overflow: str = OVERFLOW_DROP_OLDEST
    # Offer the enabled MCP tools to the model in this chat (when any server has some ready).
    tools: bool = True

    def to_params(self) -> SamplingParams:
        """Raises `RequestError` naming the invalid field."""
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens, seed=self.seed,
            **self._json_constraint(),
        )

    def _json_constraint(self) -> dict[str, Any]:
        if not self.json_mode:
            return {}
        if not self.json_schema.strip():
            return {"json_object": True}
        try:
            schema = json.loads(self.json_schema)
        except json.JSONDecodeError as e:
            raise RequestError(f"JSON schema is not valid JSON: {e}", param="json_schema") from None
        if not isinstance(schema, dict):
            raise RequestError("JSON schema must be a JSON object", param="json_schema")
        return {"json_schema": schema}

    def validate(self) -> None:
        self.to_params()
        if self.context_overflow not in OVERFLOW_POLICIES:
            raise RequestError(f"context_overflow must be one of {', '.join(OVERFLOW_POLICIES)}, got "
                               f"{self.context_overflow!r}", param="context_overflow")

    def to_dict(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens, "seed": self.seed,
                "json_mode": self.json_mode, "json_schema": self.json_schema, "context_overflow": self.context_overflow,
                "tools": self.tools}

    @classmethod
    def from_dict(cls, data: dict[str, Any], defaults: ChatSettings | None = None) -> ChatSettings:
        """Missing keys take `defaults`; unknown keys are ignored (rows written by newer versions)."""
        base = defaults or cls()
        known = {k: data[k] for k in base.to_dict() if k in data}
        return replace(base, **known)

    def summary(self) -> str:
        seed = "random" if self.seed is None else str(self.seed)
        json_mode = (" · JSON schema" if self.json_schema.strip() else " · JSON") if self.json_mode else ""
        overflow = " · stop when full" if self.context_overflow == OVERFLOW_STOP else ""
        tools = "" if self.tools else " · tools off"
        return (f"temperature {self.temperature:g} · top-p {self.top_p:g} · max {self.max_tokens} · seed {seed}"
                f"{json_mode}{overflow}{tools}")


@dataclass(frozen=True)
class Config:
    model: str | None = None
    device: str | None = None
    theme: str | None = None
    system_prompt: str = ""
    export_dir: Path | None = None
    sampling: ChatSettings = field(default_factory=ChatSettings)
    keymap: dict[str, str] = field(default_factory=dict)
    server_host: str = "127.0.0.1"
    server_port: int = 8000
    kv_disk_cache_dir: str | None = None
    kv_disk_cache_bytes: int | None = None
    path: Path | None = None  # the file it was read from, if any

    def engine_settings(self) -> dict[str, Any]:
        """The engine settings this config holds (the KV disk tier's), as `EngineConfig` names them."""
        names = ("kv_disk_cache_dir", "kv_disk_cache_bytes")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


def default_data_dir() -> Path:
    return Path(platformdirs.user_data_dir(APP_NAME))


def default_config_path() -> Path:
    return Path(platformdirs.user_config_dir(APP_NAME)) / "config.toml"


_TOP_LEVEL = MappingProxyType({"model": str, "device": str, "theme": str, "system_prompt": str, "export_dir": str,
                               "context_overflow": str, "kv_disk_cache_dir": str, "kv_disk_cache_bytes": int})
_SAMPLING = MappingProxyType({"temperature": (int, float), "top_p": (int, float), "max_tokens": int, "seed": int})
_SERVER = MappingProxyType({"host": str, "port": int})
# [tools] and [mcp_servers.NAME] belong to app.tools.config (`read_tools_config` reads them).
_TABLES = frozenset({"sampling", "keymap", "server", *TOOLS_TABLES})


def load_config(path: Path | None = None, *, explicit: bool = False) -> Config:
    """Read the config at `path` (default: the user config dir). A missing default file means
    defaults; a missing file named explicitly (`--config`) is an error."""
    path = Path(path).expanduser() if path is not None else default_config_path()
    if not path.exists():
        if explicit:
            raise ConfigError(f"config file {path} does not exist")
        return Config()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read config {path}: {e}") from None
    return parse_config(data, path)


def parse_config(data: dict[str, Any], path: Path | None = None) -> Config:
    where = str(path) if path else "config"
    unknown = set(data) - set(_TOP_LEVEL) - _TABLES
    if unknown:
        raise ConfigError(f"unknown key {sorted(unknown)[0]!r} in {where}; known: {', '.join(sorted(set(_TOP_LEVEL) | _TABLES))}")
    top = _typed(data, _TOP_LEVEL, where, "")
    sampling = _typed(_table(data, "sampling", where), _SAMPLING, where, "sampling.")
    server = _typed(_table(data, "server", where), _SERVER, where, "server.")
    settings = ChatSettings.from_dict({**sampling, **{k: top[k] for k in ("context_overflow",) if k in top}})
    try:
        settings.validate()
    except RequestError as e:
        raise ConfigError(f"{'[sampling]' if e.param != 'context_overflow' else 'config'} in {where}: {e}") from None
    export_dir, model = top.get("export_dir"), top.get("model")
    return Config(
        model=str(Path(model).expanduser()) if model else None,
        device=top.get("device"),
        theme=top.get("theme"),
        system_prompt=top.get("system_prompt", ""),
        export_dir=Path(export_dir).expanduser() if export_dir else None,
        sampling=settings,
        keymap=_keymap(_table(data, "keymap", where), where),
        server_host=server.get("host", "127.0.0.1"),
        server_port=server.get("port", 8000),
        kv_disk_cache_dir=str(Path(top["kv_disk_cache_dir"]).expanduser()) if top.get("kv_disk_cache_dir") else None,
        kv_disk_cache_bytes=top.get("kv_disk_cache_bytes"),
        path=path,
    )


def _table(data: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    value = data.get(name, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{name!r} in {where} must be a table ([{name}])")
    return value


def _typed(table: dict[str, Any], schema: Mapping[str, Any], where: str, prefix: str) -> dict[str, Any]:
    out = {}
    for key, value in table.items():
        if key in _TABLES and not prefix:
            continue
        if key not in schema:
            raise ConfigError(f"unknown key {prefix}{key!r} in {where}; known: {', '.join(sorted(schema))}")
        want = schema[key]
        if isinstance(value, bool) or not isinstance(value, want):
            names = "number" if want == (int, float) else want.__name__
            raise ConfigError(f"{prefix}{key} in {where} must be a {names}, got {value!r}")
        out[key] = value
    return out


def _keymap(table: dict[str, Any], where: str) -> dict[str, str]:
    # Imported here: commands.py pulls in Textual, which config users (the CLI) may not need.
    from app.ui.commands import ACTION_IDS

    for binding_id, keys in table.items():
        if binding_id not in ACTION_IDS:
            raise ConfigError(f"unknown binding id {binding_id!r} in [keymap] of {where}; known: {', '.join(ACTION_IDS)}")
        if not isinstance(keys, str) or not keys.strip():
            raise ConfigError(f"keymap.{binding_id} in {where} must be a key string such as \"ctrl+t\"")
    return dict(table)
