"""The tool manager against real MCP server subprocesses (tests/tools/servers/): listing, the
built-in server, servers that never start, exit at start or crash mid-call, a call that hangs,
a huge result, cancellation, switches and restart. One server's trouble touches no other."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from app.tools.config import BUILTIN_NAME, ServerConfig, ToolsConfig
from app.tools.errors import ToolCallError
from app.tools.manager import ServerState, ToolManager, offered_name

FIXTURE = str(Path(__file__).parent / "servers" / "fixture_server.py")


def fixture(name: str, mode: str = "ok", **kw) -> ServerConfig:
    return ServerConfig(name, command=sys.executable, args=(FIXTURE, mode), **kw)


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    work = tmp_path_factory.mktemp("work")
    (work / "notes.txt").write_text("alpha\nbeta\n")
    config = ToolsConfig(servers=(fixture("fx", auto_approve=frozenset({"echo"})), fixture("crashy"),
                                  fixture("silent", "silent", startup_timeout=1.0), fixture("broken", "broken"),
                                  ServerConfig("missing", command="no-such-command-for-localbatch")),
                         max_result_chars=2000)
    changes: list[float] = []
    m = ToolManager(config, work, on_change=lambda: changes.append(time.monotonic()))
    m.health_interval = 0.3
    started = time.monotonic()
    m.start()
    assert time.monotonic() - started < 0.5  # nobody waits for the servers
    assert m.wait_settled(30)
    assert changes
    yield m
    m.close()


def test_states_and_reasons(manager: ToolManager) -> None:
    lines = {s.name: s.line() for s in manager.servers()}
    assert [s.name for s in manager.servers()] == [BUILTIN_NAME, "fx", "crashy", "silent", "broken", "missing"]
    assert lines[BUILTIN_NAME] == f"{BUILTIN_NAME} · ready · 4 tools"
    assert lines["fx"] == "fx · ready · 6 tools"
    assert lines["silent"] == "silent · failed: did not answer within 1 s"
    assert lines["broken"] == "broken · failed: exited (stderr: fixture: cannot open the database)"
    assert lines["missing"] == "missing · failed: command not found: no-such-command-for-localbatch"


def test_a_missing_working_directory_is_not_called_a_missing_command(tmp_path) -> None:
    """The OS names the missing file; the reason names the command, or the `cwd` when that is it."""
    config = ToolsConfig(servers=(ServerConfig("nowhere", command=sys.executable, cwd=str(tmp_path / "gone")),
                                  ServerConfig("nosuch", command="nosuchcmd", args=("--flag",))), builtin=False)
    m = ToolManager(config)
    m.start()
    try:
        assert m.wait_settled(20)
        assert [s.line() for s in m.servers()] == [f"nowhere · failed: working directory not found: {tmp_path / 'gone'}",
                                                   "nosuch · failed: command not found: nosuchcmd"]
    finally:
        m.close()


def test_offered_tools(manager: ToolManager) -> None:
    offered = {t.offered_name: t for t in manager.offered_tools()}
    assert "files__read_file" in offered and "fx__echo" in offered
    assert not any(name.startswith(("silent", "broken", "missing")) for name in offered)
    echo = offered["fx__echo"]
    assert echo.auto_approve and not offered["fx__big"].auto_approve
    assert offered["files__search"].auto_approve and not offered["files__apply_edit"].auto_approve
    spec = echo.openai()["function"]
    assert spec["name"] == "fx__echo" and spec["description"] == "Repeat the text."
    assert spec["parameters"]["required"] == ["text"]
    assert offered_name("my.server", "do it!") == "my_server__do_it_"


def test_calls(manager: ToolManager) -> None:
    assert manager.call("fx__echo", {"text": "hi", "times": 2}).result(10).content == "hi hi"
    read = manager.call("files__read_file", {"path": "notes.txt"}).result(10)
    assert read.content == "notes.txt: lines 1-2 of 2\nalpha\nbeta\n"
    refused = manager.call("files__read_file", {"path": "../x"}).result(10)
    assert refused.is_error and "outside the working directory" in refused.content
    wrong = manager.call("fx__echo", {"times": 2}).result(10)
    assert wrong.is_error and wrong.content.startswith("Error")
    assert manager.call("nope__x", {}).result(10).content == "Error: there is no tool named 'nope__x'"
    picture = manager.call("fx__picture", {}).result(10)
    assert picture.attachments == ("image/png image, 900 bytes",)
    assert picture.content == "a red dot\n[image/png image, 900 bytes: not shown]"


def test_prompts(manager: ToolManager) -> None:
    review = [p for p in manager.prompts() if p.server == "fx"]
    assert [(p.name, p.description, p.arguments) for p in review] == [("review", "Review a file.", (("path", True),))]
    assert manager.get_prompt("fx", "review", {"path": "a.py"}).result(10) == [
        {"role": "user", "content": "Please review a.py for bugs."}]
    with pytest.raises(ToolCallError, match="not ready"):
        manager.get_prompt("broken", "review").result(10)


def test_huge_result_is_cut(manager: ToolManager) -> None:
    result = manager.call("fx__big", {"chars": 1_000_000}).result(20)
    assert result.truncated and len(result.content) < 2200
    assert result.content.endswith("not shown; ask for less, e.g. a smaller range or a narrower pattern]")


def test_hang_times_out_and_server_stays(manager: ToolManager) -> None:
    result = manager.call("fx__hang", {}, timeout=0.5).result(10)
    assert result.is_error and result.content == "Error: fx__hang did not answer within 0.5 s"
    assert manager.call("fx__echo", {"text": "still here"}).result(10).content == "still here"


async def test_cancel_a_call(manager: ToolManager) -> None:
    task = asyncio.ensure_future(manager.call_async("fx__hang", {}))
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await manager.call_async("fx__echo", {"text": "after"})).content == "after"


def test_crash_mid_call_then_restart(manager: ToolManager) -> None:
    result = manager.call("crashy__crash", {}).result(20)
    assert result.is_error and result.content == "Error: the MCP server 'crashy' exited during the call"
    assert manager.server("crashy").state is ServerState.FAILED
    assert manager.call("crashy__echo", {"text": "x"}).result(10).is_error
    assert manager.call("fx__echo", {"text": "others work"}).result(10).content == "others work"
    manager.restart("crashy")
    _wait(lambda: manager.server("crashy").state is ServerState.READY)
    assert manager.call("crashy__echo", {"text": "back"}).result(10).content == "back"


def test_exit_while_idle_shows(manager: ToolManager) -> None:
    _wait(lambda: manager.server("crashy").state is ServerState.READY)
    assert manager.call("crashy__exit_soon", {}).result(10).content == "bye"
    _wait(lambda: manager.server("crashy").state is ServerState.FAILED)
    assert manager.server("crashy").line() == "crashy · failed: exited"
    time.sleep(1)  # pings of the live servers are answered: they stay ready
    assert manager.server("fx").state is ServerState.READY
    manager.restart("crashy")


def test_switches(manager: ToolManager) -> None:
    manager.set_tool_enabled("fx", "big", False)
    _wait(lambda: "fx__big" not in {t.offered_name for t in manager.offered_tools()})
    assert manager.server("fx").line() == "fx · ready · 5 of 6 tools on"
    assert manager.call("fx__big", {"chars": 3}).result(10).content == "Error: the tool fx__big is turned off"
    manager.set_tool_enabled("fx", "big", True)
    manager.set_server_enabled("crashy", False)
    _wait(lambda: manager.server("crashy").line() == "crashy · off")
    assert not any(t.server == "crashy" for t in manager.offered_tools())
    manager.set_server_enabled("crashy", True)
    _wait(lambda: manager.server("crashy").state is ServerState.READY)


def _wait(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_streamable_http_server(tmp_path) -> None:
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "http.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, FIXTURE, "ok", "--http", str(port)], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "http.log").read_text()
            time.sleep(0.1)
        config = ToolsConfig(servers=(ServerConfig("web", url=f"http://127.0.0.1:{port}/mcp"),
                                      ServerConfig("gone", url="http://127.0.0.1:1/mcp", startup_timeout=5)),
                             builtin=False)
        manager = ToolManager(config)
        manager.start()
        try:
            assert manager.wait_settled(30)
            assert manager.server("web").line() == "web · ready · 6 tools"
            assert manager.server("gone").state is ServerState.FAILED
            assert manager.call("web__echo", {"text": "over http"}).result(10).content == "over http"
            assert manager.call("web__hang", {}, timeout=0.5).result(10).content.endswith("within 0.5 s")
        finally:
            manager.close()
    finally:
        proc.kill()  # uvicorn would wait for the hanging call
        proc.wait(10)
        log.close()


def test_switches_before_start_and_name_clashes() -> None:
    manager = ToolManager(ToolsConfig(servers=(ServerConfig("a", command="x"),), builtin=False))
    manager.set_server_enabled("a", False)
    manager.set_tool_enabled("a", "t", False)
    assert manager.server("a").line() == "a · off"
    manager.start()
    assert manager.wait_settled(5) and manager.server("a").state is ServerState.STOPPED  # off: not started
    manager.close()

    class Tool:
        def __init__(self, name: str) -> None:
            self.name, self.description, self.input_schema = name, "", None

    server = manager._servers["a"]
    infos = manager._tool_infos(server, [Tool("do.it"), Tool("do_it"), Tool("do it")])
    assert [t.offered_name for t in infos] == ["a__do_it", "a__do_it_2", "a__do_it_3"]
    assert infos[0].input_schema == {"type": "object", "properties": {}}
