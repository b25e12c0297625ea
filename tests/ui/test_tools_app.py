"""MCP tools in the real app, against real MCP server subprocesses (tests/tools/servers): the tools
view, the approval card (enter, a, esc), auto_approve, a server that never starts, one that crashes
mid-call, one that hangs, a huge result, the step limit, and the stored tool turns after a restart.
The fake engine plays a model that calls a tool named by the user's message, then answers with the
result it read."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from textual.widgets import OptionList, Static

from app.tools.approval import REFUSED_TEXT
from app.tools.manager import ServerState
from app.ui.reply_stream import StreamingBody
from app.ui.tools_view import ApprovalCard, ToolsScreen
from app.ui.widgets import MessageView
from tests.support.fake_engine import FakeTokenizer, ToolTemplateEngine
from tests.ui.test_tui import SIZE, chat_screen, idle, make_app, type_and_send, until

SERVER = Path(__file__).resolve().parents[1] / "tools" / "servers" / "fixture_server.py"
CALLS = {"echo": {"text": "hi"}, "big": {"chars": 50_000}, "crash": {}, "hang": {}, "loop": {"text": "again"}}


def model(prompt: Any) -> list[str]:
    """The user's last message names the tool (`call echo`); once a result came back in this turn,
    the answer quotes its first line. `loop` calls echo for ever (the step limit ends it)."""
    text = FakeTokenizer().decode(prompt) if isinstance(prompt, list) and isinstance(prompt[0], int) else str(prompt)
    turn = text.rsplit("<user>", 1)[-1]
    wanted = turn.split("\n", 1)[0].removeprefix("call ").strip()
    if "<tool>" in turn and wanted != "loop":
        result = turn.rsplit("<tool>", 1)[1].split("\n", 1)[0]
        return ["Done", f": {result[:60]}"]
    name = "echo" if wanted == "loop" else wanted
    call = json.dumps({"name": f"fx__{name}", "arguments": CALLS.get(wanted, {})})
    return ["Let me look.", "<tool_call>", call, "</tool_call>"]


def config(*extra: str, **fx: str) -> str:
    spec = {"command": json.dumps(sys.executable), "args": json.dumps([str(SERVER), "ok"]), **fx}
    lines = ["[tools]", "builtin = false", "max_result_chars = 2000", "step_limit = 2", "", "[mcp_servers.fx]"]
    return "\n".join(lines + [f"{k} = {v}" for k, v in spec.items()] + ["", *extra]) + "\n"


async def ready(pilot: Any, app: Any, name: str = "fx") -> None:
    await until(pilot, lambda: app.tools is not None and app.tools.server(name).state is not ServerState.STARTING,
                timeout=20)
    assert app.tools.server(name).state is ServerState.READY, app.tools.server(name).line()


def stored(app: Any, pane: Any) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in app.store.messages(pane.session.chat.id)]


async def answer_card(pilot: Any, pane: Any, key: str) -> ApprovalCard:
    await until(pilot, lambda: bool(pane.query(ApprovalCard)), timeout=10)
    card = pane.query_one(ApprovalCard)
    assert pilot.app.focused is card
    await pilot.press(key)
    return card


async def test_approve_refuse_always_auto_approve_limit_and_restart(tmp_path: Path) -> None:
    engine = ToolTemplateEngine(model_name="fake", max_model_len=8192, script=model)
    broken = '[mcp_servers.bad]\ncommand = "lb-nosuchcommand"\n'
    app, _ = make_app(tmp_path, engine, config(broken, auto_approve='["big"]'), tools=True)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        pane = screen.active_pane()
        await ready(pilot, app)
        assert app.tools.server("bad").line() == "bad · failed: command not found: lb-nosuchcommand"

        # The tools view lists the servers, their state and their tools.
        await pilot.press("f10")
        await until(pilot, lambda: isinstance(app.screen, ToolsScreen))
        rows = [str(app.screen.query_one(OptionList).get_option_at_index(i).prompt)
                for i in range(app.screen.query_one(OptionList).option_count)]
        assert rows[0].startswith("● fx · ready · 6 tools") and any("echo · Repeat the text." in r for r in rows)
        assert any("big (runs without asking)" in r for r in rows)
        assert any("✗ bad · failed: command not found: lb-nosuchcommand" in r for r in rows)
        # Each line of a row stays one line on screen, in a 64-column terminal too (a wrapped reason
        # put its command on the next line, where it read as the command line).
        await pilot.resize_terminal(64, SIZE[1])
        await pilot.pause(0.2)
        view = app.screen.query_one(OptionList)
        painted = [view.render_line(y).text.rstrip() for y in range(view.size.height)]
        assert "✗ bad · failed: command not found: lb-nosuchcommand" in painted
        assert "    lb-nosuchcommand" in painted
        assert any(line.startswith("    /") and line.endswith("…") for line in painted)  # fx's command line, cut
        await pilot.resize_terminal(*SIZE)
        await pilot.pause(0.2)
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is screen)

        # enter runs the call once; the reply after it reads the result.
        await type_and_send(pilot, "call echo")
        card = await answer_card(pilot, pane, "enter")
        assert card.card.title == "fx · echo" and card.card.arguments == {"text": "hi"}
        await idle(pilot, screen)
        assert stored(app, pane)[1:] == [("assistant", "Let me look."), ("tool", "hi"), ("assistant", "Done: hi")]
        assert app.focused is pane.prompt
        first, second = engine.submitted[-2].prompt, engine.submitted[-1].prompt
        assert second[:len(first)] == first  # the continuation starts with the same tokens: its prefix is cached
        # The tools' definitions count in the context meter, as they do in the prompt.
        # (The count passes a call's arguments as the stored JSON text, the prompt as an object: a
        # few characters apart with this template.)
        tools_tokens = pane.session.context.tools_tokens
        assert tools_tokens > 50 and abs(pane.session.chat_tokens(recount=True) - len(second) - 20) < 10

        # esc refuses: the model is told.
        await type_and_send(pilot, "call echo")
        await answer_card(pilot, pane, "escape")
        await idle(pilot, screen)
        assert stored(app, pane)[-2] == ("tool", REFUSED_TEXT) and app.focused is pane.prompt

        # a: always, in this chat; the next call of the tool asks nothing.
        await type_and_send(pilot, "call echo")
        await answer_card(pilot, pane, "a")
        await idle(pilot, screen)
        await type_and_send(pilot, "call echo")
        await idle(pilot, screen)
        assert not pane.query(ApprovalCard) and stored(app, pane)[-2:] == [("tool", "hi"), ("assistant", "Done: hi")]

        # auto_approve: no card; a huge result is cut with a note.
        await type_and_send(pilot, "call big")
        await idle(pilot, screen)
        result = stored(app, pane)[-2][1]
        assert len(result) < 2300 and "[output cut: " in result

        # The step limit ends a loop of calls, and says so.
        await type_and_send(pilot, "loop")
        await idle(pilot, screen)
        tail = stored(app, pane)
        loop_start = max(i for i, (r, c) in enumerate(tail) if r == "user")
        assert [r for r, _ in tail[loop_start:]] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
        notes = [v for v in pane.query(MessageView) if v.role == "note"]
        assert notes and "step limit" in notes[-1]._content
        count = len(tail)
        await app.action_quit()

    # A restart shows the stored calls and results.
    app, _ = make_app(tmp_path, ToolTemplateEngine(model_name="fake", max_model_len=8192, script=model))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        pane = screen.active_pane()
        pane.message_list.show_older(100)
        await until(pilot, lambda: len(pane.query(MessageView)) == count)
        views = list(pane.query(MessageView))
        assert "→ fx__echo({\"text\": \"hi\"})" in views[1]._content and views[2].role == "tool"


async def test_an_edit_card_shows_the_change_in_the_file(tmp_path: Path, monkeypatch: Any) -> None:
    """The built-in server's apply_edit: the card shows the file's diff with context and line
    numbers; an edit that would fail says why in one line over the arguments' diff."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "a.py").write_text("".join(f"line {i}\n" for i in range(1, 13)))
    monkeypatch.chdir(project)  # the built-in server serves the app's working directory
    edits = {"seven": {"path": "a.py", "search": "line 7\n", "replace": "line seven\n"},
             "seventy": {"path": "a.py", "search": "line 70\n", "replace": "x\n"}}

    def editing(prompt: Any) -> list[str]:
        turn = FakeTokenizer().decode(prompt).rsplit("<user>", 1)[-1]
        if "<tool>" in turn:
            return ["Done"]
        call = {"name": "files__apply_edit", "arguments": edits[turn.split("\n", 1)[0].strip()]}
        return ["<tool_call>", json.dumps(call), "</tool_call>"]

    engine = ToolTemplateEngine(model_name="fake", max_model_len=8192, script=editing)
    app, _ = make_app(tmp_path, engine, "[tools]\nbuiltin = true\n", tools=True)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        pane = screen.active_pane()
        await ready(pilot, app, "files")
        await type_and_send(pilot, "seven")
        await until(pilot, lambda: bool(pane.query(ApprovalCard)), timeout=10)
        card = pane.query_one(ApprovalCard)
        assert card.card.note is None and not card.query(".approval-note")
        await pilot.press("escape")
        assert card.card.diff == ("--- a/a.py\n+++ b/a.py\n@@ -4,7 +4,7 @@\n line 4\n line 5\n line 6\n"
                                  "-line 7\n+line seven\n line 8\n line 9\n line 10\n")
        await idle(pilot, screen)
        await type_and_send(pilot, "seventy")
        await until(pilot, lambda: bool(pane.query(ApprovalCard)), timeout=10)
        card = pane.query_one(ApprovalCard)
        said = "search text not found in the file; read the file and copy the text exactly"
        assert card.card.note == said and card.card.diff == "--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-line 70\n+x\n"
        note = card.query_one(".approval-note", Static)
        assert str(note.content) == f"⚠ If run, it fails: {said}" and note.size.height >= 1
        await pilot.press("enter")
        await idle(pilot, screen)
        # The failed edit's reply must call again (the fake calls list_files, auto-approved, and
        # it fails too); after two failed rounds the reply is free.
        assert stored(app, pane)[-4] == ("tool", f"Error executing tool apply_edit: {said}")
        assert stored(app, pane)[-2][1].startswith("Error executing tool list_files")
        assert [s.params.structural_tag["format"]["type"] for s in engine.submitted[-2:]] == ["tags_with_separator", "or"]
        assert (project / "a.py").read_text().count("line") == 12
        await app.action_quit()


async def test_a_call_being_written_shows_as_a_line_not_as_json(tmp_path: Path) -> None:
    """While the model writes a call, the live reply says so under its text; the call's JSON is
    never shown as text."""
    def slow_call(prompt: Any) -> list[str]:
        pieces = model(prompt)
        if pieces[0] != "Let me look.":
            return pieces
        return ["Let me look.", "<tool_call>", '\n{"name": "fx__echo", ', '"arguments": {"text": "h',
                *["i"] * 60, '"}}\n', "</tool_call>"]

    engine = ToolTemplateEngine(model_name="fake", max_model_len=8192, script=slow_call, step_delay=0.1)
    app, _ = make_app(tmp_path, engine, config(auto_approve='["echo"]'), tools=True)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        pane = screen.active_pane()
        await ready(pilot, app)
        await type_and_send(pilot, "call echo")

        def writing() -> StreamingBody | None:
            return next((b for b in pane.query(StreamingBody) if b.display and b.status), None)

        await until(pilot, lambda: writing() is not None, timeout=20)
        body = writing()
        assert body is not None and body.status == "writing a call to fx__echo…"
        await pilot.pause(0.2)
        painted = "\n".join(strip.text for strip in body._lines)
        assert "Let me look." in painted and "writing a call to fx__echo…" in painted and "{" not in painted
        await until(pilot, lambda: not pane.generating, timeout=30)
        assert stored(app, pane)[1:] == [("assistant", "Let me look."), ("tool", "h" + "i" * 60),
                                         ("assistant", "Done: " + ("h" + "i" * 60)[:60])]
        assert not any(b.display and b.status for b in pane.query(StreamingBody))


async def test_a_server_that_never_starts_crashes_or_hangs(tmp_path: Path) -> None:
    engine = ToolTemplateEngine(model_name="fake", max_model_len=8192, script=model)
    silent = (f'[mcp_servers.quiet]\ncommand = {json.dumps(sys.executable)}\n'
              f'args = {json.dumps([str(SERVER), "silent"])}\nstartup_timeout_sec = 1\n')
    app, _ = make_app(tmp_path, engine, config(silent, auto_approve='["crash", "hang"]', tool_timeout_sec="1"),
                      tools=True)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        pane = screen.active_pane()
        await ready(pilot, app)
        await until(pilot, lambda: app.tools.server("quiet").state is ServerState.FAILED, timeout=10)
        assert app.tools.server("quiet").line() == "quiet · failed: did not answer within 1 s"

        await type_and_send(pilot, "call hang")  # times out; the server stays
        # The reply after a failed round must call (the fake calls fx__echo, which asks): refused.
        await until(pilot, lambda: isinstance(app.focused, ApprovalCard), timeout=10)
        await pilot.press("escape")
        await idle(pilot, screen)
        assert stored(app, pane)[2] == ("tool", "Error: fx__hang did not answer within 1 s")

        await type_and_send(pilot, "call crash")  # the server dies during the call
        await until(pilot, lambda: len(stored(app, pane)) >= 10, timeout=10)
        await idle(pilot, screen)
        assert stored(app, pane)[-2] == ("tool", "Error: the MCP server 'fx' exited during the call")
        assert app.tools.server("fx").state is ServerState.FAILED

        await pilot.press("f10")  # the view shows why, and r restarts it
        await until(pilot, lambda: isinstance(app.screen, ToolsScreen))
        rows = app.screen.query_one(OptionList)
        assert "fx · failed: exited" in str(rows.get_option_at_index(0).prompt)
        rows.highlighted = 0
        await pilot.press("r")
        await ready(pilot, app)
        await pilot.press("space")  # the server off
        await until(pilot, lambda: not app.tools.server("fx").enabled)
        assert "fx · off" in str(rows.get_option_at_index(0).prompt)
        await pilot.press("escape")
        await app.action_quit()


async def test_esc_during_a_call_cancels_it_and_tools_switch_off_per_tab(tmp_path: Path) -> None:
    """The server comes from an mcp.json (`--mcp-config`)."""
    engine = ToolTemplateEngine(model_name="fake", max_model_len=8192, script=model)
    mcp_json = tmp_path / "mcp.json"
    mcp_json.write_text(json.dumps({"mcpServers": {"fx": {"command": sys.executable, "args": [str(SERVER), "ok"],
                                                          "autoApprove": ["hang"]}}}))
    app, _ = make_app(tmp_path, engine, "[tools]\nbuiltin = false\n", tools=True, mcp_config=mcp_json)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        pane = screen.active_pane()
        await ready(pilot, app)
        await type_and_send(pilot, "call hang")
        await until(pilot, lambda: pane.session.running_tools, timeout=10)
        await pilot.press("escape")
        await idle(pilot, screen)
        assert stored(app, pane)[-1][0] == "tool" and "cancelled" in stored(app, pane)[-1][1]

        await pilot.press("f11")  # tools off in this tab: a plain request, stored with the chat
        assert not app.store.chat(pane.session.chat.id).settings.tools
        await type_and_send(pilot, "call echo")
        await idle(pilot, screen)
        assert engine.submitted[-1].params.structural_tag is None
        assert stored(app, pane)[-1][0] == "assistant" and not pane.query(ApprovalCard)

        # A server's MCP prompt: tab completes /name, and its text is what is sent.
        pane.prompt.insert("/rev")
        await pilot.press("tab")
        assert pane.prompt.text == "/review "
        pane.prompt.insert("calc.py")
        await pilot.press("enter")
        await until(pilot, lambda: stored(app, pane)[-1] == ("user", "Please review calc.py for bugs.")
                    or stored(app, pane)[-2] == ("user", "Please review calc.py for bugs."), timeout=10)
        await idle(pilot, screen)
        assert pane.prompt.text == ""
        await app.action_quit()


async def test_a_bad_config_entry_is_one_line_and_the_app_works(tmp_path: Path) -> None:
    engine = ToolTemplateEngine(model_name="fake", max_model_len=8192, script=model)
    app, _ = make_app(tmp_path, engine, '[mcp_servers.x]\ncommand = 3\n', tools=True)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        assert app.tools is None and app.tools_off_reason.startswith("Tools are off: mcp_servers.x.command in ")
        assert "\n" not in app.tools_off_reason
        await type_and_send(pilot, "hello")
        await idle(pilot, screen)
        assert stored(app, screen.active_pane())[-1][0] == "assistant"
        await pilot.press("f10")
        await until(pilot, lambda: isinstance(app.screen, ToolsScreen))
        assert "Tools are off: mcp_servers.x.command" in str(app.screen.query_one(OptionList).get_option_at_index(0).prompt)


def test_the_command_line_takes_an_mcp_json() -> None:
    from app.cli import build_parser

    assert build_parser().parse_args(["--mcp-config", "servers.json"]).mcp_config == "servers.json"


def test_prompt_commands_take_key_values_or_the_rest_of_the_line() -> None:
    import pytest

    from app.tools.manager import PromptInfo
    from app.ui.session.prompts import complete_prompt, find_prompt

    prompts = [PromptInfo("fx", "review", "", (("path", True),)), PromptInfo("fx", "explain", "", ())]
    assert find_prompt("/review a b.py", prompts) == (prompts[0], {"path": "a b.py"})
    assert find_prompt("/review path=x.py", prompts) == (prompts[0], {"path": "x.py"})
    assert find_prompt("/explain", prompts) == (prompts[1], {})
    assert find_prompt("/other x", prompts) is None and find_prompt("review", prompts) is None
    with pytest.raises(ValueError, match="/review needs path: /review path=…"):
        find_prompt("/review", prompts)
    assert complete_prompt("e", prompts) == ("explain", ["explain"]) and complete_prompt("", prompts)[1] == [
        "explain", "review"]
