"""The app's MCP client: the configured servers, each connected in the background, their tools,
and calls to them.

`ToolManager` owns one asyncio loop on its own thread ("mcp"); every server is a task there, so
neither the UI's loop nor the engine's step thread ever waits on a server. Its state is read
through frozen snapshots (`servers()`, `offered_tools()`), safe from any thread; `on_change` is
called on the manager's thread after each change (the UI forwards it with `call_from_thread`).

A server is starting, ready, failed (with a one-line reason: not found, exited, did not answer
within its startup timeout, ...) or stopped; an idle server is pinged every `health_interval`
seconds, so one that exits shows as failed before the next call. One server's failure touches no other. A call
returns a `ToolResult` in every case: a tool's own error, a timeout, a server that died during
the call and a cancelled call all come back as error text the model can read."""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import re
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.shared.exceptions import MCPError
from mcp.types import CONNECTION_CLOSED, REQUEST_TIMEOUT

from app.tools.config import ServerConfig, ToolsConfig
from app.tools.errors import ToolCallError
from app.tools.results import ToolResult, error_result, from_call_result, prompt_text

NAME_SEPARATOR = "__"  # offered name = server + "__" + tool: OpenAI's [A-Za-z0-9_-]{1,64}
_INVALID = re.compile(r"[^A-Za-z0-9_-]")
_STOP_TIMEOUT = 5.0
HEALTH_INTERVAL = 3.0  # seconds between pings of an idle server
_PING_TIMEOUT = 10.0


class ServerState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass(frozen=True)
class ToolInfo:
    server: str
    name: str  # the server's name for the tool
    offered_name: str  # the name the model calls it by
    description: str
    input_schema: Mapping[str, Any]
    enabled: bool = True
    auto_approve: bool = False
    root: str | None = None  # the working directory, for the built-in server's tools (edits are previewed there)

    def openai(self) -> dict[str, Any]:
        """The OpenAI `tools` entry (what chat templates render and the constraint is built from)."""
        return {"type": "function", "function": {"name": self.offered_name, "description": self.description,
                                                 "parameters": dict(self.input_schema)}}


@dataclass(frozen=True)
class PromptInfo:
    """A server's MCP prompt, offered as `/name` in the chat input."""

    server: str
    name: str
    description: str
    arguments: tuple[tuple[str, bool], ...] = ()  # (name, required)


@dataclass(frozen=True)
class ServerStatus:
    name: str
    state: ServerState
    reason: str | None = None  # why it failed or stopped
    tools: tuple[ToolInfo, ...] = ()
    prompts: tuple[PromptInfo, ...] = ()
    enabled: bool = True
    target: str = ""  # command line or URL

    def line(self) -> str:
        """One line for the tools view: `files · ready · 4 tools`, `web · failed: command not found: x`."""
        if self.state is ServerState.READY:
            on = sum(t.enabled for t in self.tools)
            count = f"{len(self.tools)} tools" if on == len(self.tools) else f"{on} of {len(self.tools)} tools on"
            return f"{self.name} · ready · {count}"
        if not self.enabled:
            return f"{self.name} · off"
        return f"{self.name} · {self.state.value}" + (f": {self.reason}" if self.reason else "")


def offered_name(server: str, tool: str) -> str:
    """`server__tool`, with characters function names may not hold replaced by '_', at most 64."""
    return _INVALID.sub("_", f"{server}{NAME_SEPARATOR}{tool}")[:64]


@dataclass
class _Server:
    config: ServerConfig
    enabled: bool
    status: ServerStatus
    task: asyncio.Task[None] | None = None
    stop: asyncio.Event | None = None
    settled: asyncio.Event | None = None  # set once the start ended (ready or failed)
    client: Client | None = None
    errlog: IO[str] | None = None
    disabled_tools: set[str] = field(default_factory=set)


class ToolManager:
    def __init__(self, config: ToolsConfig, workdir: str | Path = ".",
                 on_change: Callable[[], None] | None = None) -> None:
        self.config = config
        self.on_change = on_change
        self.health_interval = HEALTH_INTERVAL
        self._servers = {
            s.name: _Server(s, s.enabled, ServerStatus(s.name, ServerState.STOPPED, None if s.enabled else "off",
                                                       enabled=s.enabled, target=s.describe()))
            for s in config.all_servers(workdir)}
        self._lock = threading.Lock()
        self._snapshot = tuple(s.status for s in self._servers.values())
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle (any thread) -----------------------------------------------------------------

    def start(self) -> None:
        """Start the manager's thread and every enabled server; returns at once."""
        if self._loop is not None:
            return
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mcp", daemon=True)
        self._thread.start()
        for server in self._servers.values():
            if server.enabled:
                self._submit(self._start(server))

    def close(self) -> None:
        """Stop every server (their processes end) and the thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        stopping = asyncio.run_coroutine_threadsafe(self._stop_all(), loop)
        try:
            stopping.result(timeout=_STOP_TIMEOUT + 2)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass  # a server slow to stop, or the loop already gone: the loop stops below either way
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        for server in self._servers.values():
            if server.errlog is not None:
                server.errlog.close()
                server.errlog = None
        if not thread.is_alive():
            loop.close()
        self._loop = self._thread = None

    def wait_settled(self, timeout: float) -> bool:
        """Block until no server is starting (tests and scripts; never from the UI's loop)."""
        loop = self._loop
        if loop is None:
            return True
        waiting = asyncio.run_coroutine_threadsafe(self._settled(), loop)
        try:
            waiting.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            waiting.cancel()
            return False
        return True

    # --- what there is (any thread) -------------------------------------------------------------

    def servers(self) -> tuple[ServerStatus, ...]:
        with self._lock:
            return self._snapshot

    def server(self, name: str) -> ServerStatus:
        for status in self.servers():
            if status.name == name:
                return status
        raise KeyError(name)

    def offered_tools(self) -> list[ToolInfo]:
        """The enabled tools of the ready, enabled servers, in config order."""
        return [t for s in self.servers() if s.enabled and s.state is ServerState.READY
                for t in s.tools if t.enabled]

    def prompts(self) -> list[PromptInfo]:
        """The prompts of the ready, enabled servers."""
        return [p for s in self.servers() if s.enabled and s.state is ServerState.READY for p in s.prompts]

    def get_prompt(self, server: str, name: str,
                   arguments: Mapping[str, str] | None = None) -> concurrent.futures.Future[list[dict[str, str]]]:
        """The prompt's messages as chat messages (`role`, `content`); raises `ToolCallError` (in
        the future) when the server is not ready or refuses."""
        if self._loop is None:
            done: concurrent.futures.Future[list[dict[str, str]]] = concurrent.futures.Future()
            done.set_exception(ToolCallError("tools are not started"))
            return done
        return asyncio.run_coroutine_threadsafe(self._get_prompt(server, name, dict(arguments or {})), self._loop)

    def find(self, offered: str) -> ToolInfo | None:
        for status in self.servers():
            for tool in status.tools:
                if tool.offered_name == offered:
                    return tool
        return None

    # --- switches (any thread) ------------------------------------------------------------------

    def set_tool_enabled(self, server: str, tool: str, enabled: bool) -> None:
        """Offer the tool or not (calls to a tool turned off are refused)."""
        target = self._servers[server]
        with self._lock:
            (target.disabled_tools.discard if enabled else target.disabled_tools.add)(tool)
        self._publish(target, tools=target.status.tools)

    def set_server_enabled(self, server: str, enabled: bool) -> None:
        """Start or stop the server (before `start()`: whether it starts then)."""
        target = self._servers[server]
        if self._loop is None:
            target.enabled = enabled
            self._publish(target, enabled=enabled, reason=None if enabled else "off")
        else:
            self._submit(self._set_server(target, enabled))

    def restart(self, server: str) -> None:
        self._submit(self._restart(self._servers[server]))

    # --- calls ----------------------------------------------------------------------------------

    def call(self, offered: str, arguments: Mapping[str, Any] | None,
             timeout: float | None = None) -> concurrent.futures.Future[ToolResult]:
        """Call the tool the model names `offered`; the future's `cancel()` cancels the call."""
        if self._loop is None:
            done: concurrent.futures.Future[ToolResult] = concurrent.futures.Future()
            done.set_result(error_result("tools are not started"))
            return done
        return asyncio.run_coroutine_threadsafe(self._call(offered, dict(arguments or {}), timeout), self._loop)

    async def call_async(self, offered: str, arguments: Mapping[str, Any] | None,
                         timeout: float | None = None) -> ToolResult:
        """`call` awaited from another asyncio loop (the UI's); cancelling the awaiting task cancels the call."""
        try:
            return await asyncio.wrap_future(self.call(offered, arguments, timeout))
        except concurrent.futures.CancelledError:
            raise asyncio.CancelledError from None

    # --- on the manager's loop ------------------------------------------------------------------

    def _submit(self, coro: Any) -> None:
        if self._loop is None:
            coro.close()
            return
        asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _publish(self, server: _Server, **changes: Any) -> None:
        with self._lock:
            if "tools" in changes:  # a tool turned off while the server was (re)starting stays off
                changes["tools"] = tuple(replace(t, enabled=t.name not in server.disabled_tools)
                                         for t in changes["tools"])
            server.status = replace(server.status, **changes)
            self._snapshot = tuple(s.status for s in self._servers.values())
        if self.on_change is not None:
            self.on_change()

    async def _start(self, server: _Server) -> None:
        if server.task is not None and not server.task.done():
            return
        server.stop, server.settled = asyncio.Event(), asyncio.Event()
        self._publish(server, state=ServerState.STARTING, reason=None, tools=(), prompts=(), enabled=True)
        server.task = asyncio.get_running_loop().create_task(self._serve(server, server.stop, server.settled))
        try:
            await asyncio.wait_for(server.settled.wait(), server.config.startup_timeout)
        except TimeoutError:
            server.task.cancel()
            await asyncio.gather(server.task, return_exceptions=True)
            self._publish(server, state=ServerState.FAILED,
                          reason=f"did not answer within {server.config.startup_timeout:g} s")
            server.settled.set()

    async def _serve(self, server: _Server, stop: asyncio.Event, settled: asyncio.Event) -> None:
        """Connect, list the tools, and hold the connection until `stop` (one task per start),
        pinging the server while idle so that one that exits shows as failed."""
        lost = False
        try:
            async with self._client(server) as client:
                tools = await _list_tools(client)
                prompts = await _list_prompts(client, server.config.name)
                server.client = client
                self._publish(server, state=ServerState.READY, tools=self._tool_infos(server, tools), prompts=prompts)
                settled.set()
                while not lost and not stop.is_set():
                    try:
                        await asyncio.wait_for(stop.wait(), self.health_interval)
                    except TimeoutError:
                        lost = not await _alive(client)
            if lost:
                self._publish(server, state=ServerState.FAILED, reason="exited" + _stderr_note(server.errlog), tools=(), prompts=())
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - anyio wraps a failed start in an exception group
            if lost:
                self._publish(server, state=ServerState.FAILED, reason="exited" + _stderr_note(server.errlog), tools=(), prompts=())
            elif not stop.is_set():
                reason = _reason(e, server.errlog, server.config)
                if server.config.url is not None and server.status.state is ServerState.STARTING:
                    reason = f"cannot reach {server.config.url}: {reason}"
                self._publish(server, state=ServerState.FAILED, reason=reason, tools=(), prompts=())
        finally:
            server.client = None
            settled.set()

    def _client(self, server: _Server) -> Client:
        cfg = server.config
        if cfg.url is not None:
            return Client(cfg.url)
        if server.errlog is not None:
            server.errlog.close()
        # The server's stderr goes to a file: on the terminal it would draw over the UI; its last
        # line is the reason shown when the server fails.
        server.errlog = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")
        params = StdioServerParameters(command=cfg.command or "", args=list(cfg.args), env=dict(cfg.env) or None,
                                       cwd=cfg.cwd)
        return Client(stdio_client(params, errlog=server.errlog))

    def _tool_infos(self, server: _Server, tools: list[Any]) -> tuple[ToolInfo, ...]:
        taken = {t.offered_name for s in self._servers.values() if s is not server for t in s.status.tools}
        out = []
        for tool in tools:
            name = base = offered_name(server.config.name, tool.name)
            n = 1
            while name in taken:  # two tools whose names differ only in characters replaced by '_'
                n += 1
                name = f"{base[:60]}_{n}"
            taken.add(name)
            out.append(ToolInfo(server.config.name, tool.name, name, (tool.description or "").strip(),
                                tool.input_schema or {"type": "object", "properties": {}},
                                tool.name not in server.disabled_tools, tool.name in server.config.auto_approve,
                                server.config.root))
        return tuple(out)

    async def _stop(self, server: _Server, reason: str | None = None) -> None:
        task = server.task
        if task is not None and not task.done():
            assert server.stop is not None
            server.stop.set()
            try:
                await asyncio.wait_for(asyncio.shield(task), _STOP_TIMEOUT)
            except TimeoutError:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            except Exception:  # noqa: BLE001, S110 - the task reported its own failure
                pass
        server.task = None
        self._publish(server, state=ServerState.STOPPED, reason=reason, tools=(), prompts=())

    async def _stop_all(self) -> None:
        await asyncio.gather(*(self._stop(s) for s in self._servers.values()), return_exceptions=True)

    async def _restart(self, server: _Server) -> None:
        await self._stop(server)
        if server.enabled:
            await self._start(server)

    async def _set_server(self, server: _Server, enabled: bool) -> None:
        server.enabled = enabled
        if enabled:
            await self._start(server)
        else:
            await self._stop(server, "off")
            self._publish(server, enabled=False)

    async def _settled(self) -> None:
        while any(s.status.state is ServerState.STARTING for s in self._servers.values()):
            await asyncio.sleep(0.02)

    async def _call(self, offered: str, arguments: dict[str, Any], timeout: float | None) -> ToolResult:
        tool = self.find(offered)
        if tool is None:
            return error_result(f"there is no tool named {offered!r}")
        server = self._servers[tool.server]
        if not server.enabled or not tool.enabled:
            return error_result(f"the tool {offered} is turned off")
        client = server.client
        if server.status.state is not ServerState.READY or client is None:
            return error_result(f"the MCP server {tool.server!r} is not ready ({server.status.line()})")
        limit = timeout or server.config.call_timeout or self.config.call_timeout
        try:
            result = await asyncio.wait_for(client.call_tool(tool.name, arguments, read_timeout_seconds=limit),
                                            limit + 1)
        except (TimeoutError, MCPError) as e:
            if isinstance(e, TimeoutError) or e.code == REQUEST_TIMEOUT:
                return error_result(f"{offered} did not answer within {limit:g} s")
            if e.code == CONNECTION_CLOSED:
                await self._lost(server)
                return error_result(f"the MCP server {tool.server!r} exited during the call")
            return error_result(f"{offered}: {_one_line(e)}")
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - the transport's errors reach here wrapped
            await self._lost(server)
            return error_result(f"{offered}: the MCP server {tool.server!r} failed: "
                                f"{_reason(e, server.errlog, server.config)}")
        return from_call_result(result, self.config.max_result_chars)

    async def _get_prompt(self, name: str, prompt: str, arguments: dict[str, str]) -> list[dict[str, str]]:
        server = self._servers.get(name)
        client = server.client if server is not None else None
        if server is None or client is None or server.status.state is not ServerState.READY:
            raise ToolCallError(f"the MCP server {name!r} is not ready")
        try:
            result = await asyncio.wait_for(client.get_prompt(prompt, arguments), self.config.call_timeout)
        except TimeoutError:
            raise ToolCallError(f"the prompt {name}/{prompt} did not come within {self.config.call_timeout:g} s") from None
        except MCPError as e:
            raise ToolCallError(f"the prompt {name}/{prompt}: {_one_line(e)}") from None
        return [{"role": m.role, "content": prompt_text(m.content)} for m in result.messages]

    async def _lost(self, server: _Server) -> None:
        """The connection broke during a call: the server failed (restart brings it back)."""
        reason = "exited" + _stderr_note(server.errlog)
        if server.stop is not None:
            server.stop.set()
        if server.task is not None:
            await asyncio.gather(server.task, return_exceptions=True)
            server.task = None
        self._publish(server, state=ServerState.FAILED, reason=reason, tools=(), prompts=())


async def _alive(client: Client) -> bool:
    """False when the connection is gone. Any answer, an error too (newer protocol versions drop
    ping), proves the server is there; one too busy to answer in time is alive."""
    try:
        await asyncio.wait_for(client.session.send_ping(), _PING_TIMEOUT)
    except TimeoutError:
        return True
    except MCPError as e:
        return e.code != CONNECTION_CLOSED
    except Exception:  # noqa: BLE001 - the transport's own errors: the connection is gone
        return False
    return True


async def _list_prompts(client: Client, server: str) -> tuple[PromptInfo, ...]:
    if client.server_capabilities.prompts is None:
        return ()
    out: list[PromptInfo] = []
    cursor: str | None = None
    while True:
        page = await client.list_prompts(cursor=cursor)
        out += [PromptInfo(server, p.name, (p.description or "").strip(),
                           tuple((a.name, bool(a.required)) for a in p.arguments or ())) for p in page.prompts]
        cursor = page.next_cursor
        if not cursor:
            return tuple(out)


async def _list_tools(client: Client) -> list[Any]:
    tools: list[Any] = []
    cursor: str | None = None
    while True:
        page = await client.list_tools(cursor=cursor)
        tools += page.tools
        cursor = page.next_cursor
        if not cursor:
            return tools


def _leaf(e: BaseException) -> BaseException:
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return e


def _reason(e: BaseException, errlog: IO[str] | None, config: ServerConfig) -> str:
    leaf = _leaf(e)
    if isinstance(leaf, FileNotFoundError) and config.command is not None:
        # The OS names the missing file: the command, or a `cwd` that does not exist.
        missing_cwd = config.cwd is not None and leaf.filename == config.cwd
        text = f"working directory not found: {config.cwd}" if missing_cwd else f"command not found: {config.command}"
    elif isinstance(leaf, FileNotFoundError):
        text = f"not found: {leaf.filename or leaf}"
    elif isinstance(leaf, MCPError) and leaf.code == CONNECTION_CLOSED:
        text = "exited"
    elif isinstance(leaf, OSError) and leaf.strerror:
        text = f"cannot start: {leaf.strerror}"
    else:
        text = _one_line(leaf) or type(leaf).__name__
    return text + _stderr_note(errlog)


def _one_line(e: BaseException) -> str:
    text = str(e.error.message) if isinstance(e, MCPError) else str(e)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0][:200] if lines else type(e).__name__


def _stderr_note(errlog: IO[str] | None) -> str:
    """The last line the server wrote to stderr, as a hint: " (stderr: ...)"."""
    if errlog is None:
        return ""
    try:
        errlog.flush()
        errlog.seek(0)
        lines = [line.strip() for line in errlog.read()[-4000:].splitlines() if line.strip()]
    except (OSError, ValueError):
        return ""
    return f" (stderr: {lines[-1][:160]})" if lines else ""
