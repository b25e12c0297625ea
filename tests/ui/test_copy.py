"""Copying to the clipboard: the last reply (ctrl+s), its last code block (ctrl+t), or any message
or block from a picker (f12), to the terminal's clipboard and a system tool when one is found;
and the fenced-block reader under it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from textual.widgets import OptionList

from app.engine.api.engine_client import Prompt
from app.ui import clipboard
from app.ui.clipboard import TOOL_ENV, ClipboardTool, CodeBlock, code_blocks, copy_text, describe
from app.ui.dialogs import CopyPicker
from app.ui.screen import ChatScreen
from tests.support.fake_engine import echo_reply
from tests.ui.test_tui import SIZE, chat_engine, chat_screen, idle, make_app, type_and_send, until

FIRST = "import os\nprint(os.getcwd())"
SECOND = "def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))"
REPLY = f"Two ways:\n\n```python\n{FIRST}\n```\n\nand then:\n\n```python\n{SECOND}\n```\n\nDone."


def code_reply(prompt: Prompt) -> list[str]:
    """A reply with two python blocks, a line a token, for prompts asking for code; else the echo."""
    messages = prompt if isinstance(prompt, list) else []
    users = [m["content"] for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if users and "code" in users[-1]:
        return REPLY.splitlines(keepends=True)
    return echo_reply(prompt)


@pytest.fixture(autouse=True)
def no_system_tool(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test spawns the machine's own clipboard tool."""
    monkeypatch.setenv(TOOL_ENV, "none")


def notices(monkeypatch: pytest.MonkeyPatch, screen: ChatScreen) -> list[tuple[str, str]]:
    shown: list[tuple[str, str]] = []
    def notify(message: str, severity: str = "information", **kw: Any) -> None:
        shown.append((message, severity))

    monkeypatch.setattr(screen, "notify", notify)
    return shown


async def replied(pilot: Any, text: str = "write code") -> ChatScreen:
    screen = await chat_screen(pilot)
    await type_and_send(pilot, text)
    await idle(pilot, screen)
    return screen


def fake_tool(tmp_path: Path, exit_code: int = 0) -> tuple[ClipboardTool, Path]:
    """A clipboard 'tool' that writes what it reads to a file, then exits with `exit_code`."""
    script, out = tmp_path / "fakeclip.py", tmp_path / "clip.out"
    script.write_text(f"import sys\nopen(sys.argv[1], 'wb').write(sys.stdin.buffer.read())\nsys.exit({exit_code})\n")
    return ClipboardTool("fakeclip", [sys.executable, str(script), str(out)]), out


# --- the actions --------------------------------------------------------------------------------


async def test_copy_code_copies_the_last_block_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app, _ = make_app(tmp_path, chat_engine(script=code_reply))
    async with app.run_test(size=SIZE) as pilot:
        screen = await replied(pilot)
        shown = notices(monkeypatch, screen)
        await pilot.press("ctrl+t")
        await pilot.pause()
        assert app.clipboard == SECOND
        assert shown == [("Copied 5 lines of python to the terminal clipboard", "information")]


async def test_copy_reply_copies_the_stored_markdown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app, _ = make_app(tmp_path, chat_engine(script=code_reply))
    async with app.run_test(size=SIZE) as pilot:
        screen = await replied(pilot)
        shown = notices(monkeypatch, screen)
        await pilot.press("ctrl+s")
        await pilot.pause()
        stored = screen.active_pane().session.messages[-1].content
        assert stored == REPLY
        assert app.clipboard == stored
        lines = len(REPLY.splitlines())
        assert shown == [(f"Copied the last reply ({lines} lines) to the terminal clipboard", "information")]


async def test_copy_code_takes_the_newest_reply_with_a_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app, _ = make_app(tmp_path, chat_engine(script=code_reply))
    async with app.run_test(size=SIZE) as pilot:
        screen = await replied(pilot)
        await type_and_send(pilot, "thanks")  # a reply without a block
        await idle(pilot, screen)
        await pilot.press("ctrl+t")
        await pilot.pause()
        assert app.clipboard == SECOND
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert app.clipboard == "Reply to: thanks"


async def test_picker_copies_the_chosen_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app, _ = make_app(tmp_path, chat_engine(script=code_reply))
    async with app.run_test(size=SIZE) as pilot:
        screen = await replied(pilot)
        shown = notices(monkeypatch, screen)
        await pilot.press("f12")
        await until(pilot, lambda: isinstance(app.screen, CopyPicker))
        options = app.screen.query_one(OptionList)
        labels = [str(options.get_option_at_index(i).prompt) for i in range(options.option_count)]
        assert labels == [
            "Assistant: Two ways:",
            "    python · 2 lines · import os",
            "    python · 5 lines · def add(a, b):",
            "You: write code",
        ]
        assert options.highlighted == 2  # the newest block
        await pilot.press("up", "enter")
        await until(pilot, lambda: app.screen is screen)
        assert app.clipboard == FIRST
        assert shown == [("Copied 2 lines of python to the terminal clipboard", "information")]


async def test_picker_copies_a_message_and_escape_cancels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app, _ = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await replied(pilot, "hello there")
        app.copy_to_clipboard("before")
        await pilot.press("f12")
        await until(pilot, lambda: isinstance(app.screen, CopyPicker))
        assert app.screen.query_one(OptionList).highlighted == 0  # no block: the newest reply
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is screen)
        assert app.clipboard == "before"
        await pilot.press("f12")
        await until(pilot, lambda: isinstance(app.screen, CopyPicker))
        await pilot.press("down", "enter")
        await until(pilot, lambda: app.screen is screen)
        assert app.clipboard == "hello there"


async def test_nothing_to_copy_warns_and_leaves_the_clipboard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app, _ = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        shown = notices(monkeypatch, screen)
        app.copy_to_clipboard("before")
        await pilot.press("ctrl+s", "ctrl+t", "f12")
        await pilot.pause()
        assert app.clipboard == "before"
        assert isinstance(app.screen, ChatScreen)
        assert shown == [("No reply to copy yet", "warning"), ("No code block in this chat yet", "warning"),
                         ("Nothing to copy yet", "warning")]
        await type_and_send(pilot, "no code here")
        await idle(pilot, screen)
        await pilot.press("ctrl+t")
        await pilot.pause()
        assert app.clipboard == "before"
        assert shown[-1] == ("No code block in this chat yet", "warning")


async def test_copy_while_streaming_takes_the_last_finished_reply(tmp_path: Path) -> None:
    app, engine = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await replied(pilot, "first")
        engine.paused = True
        await type_and_send(pilot, "second")
        await until(pilot, lambda: screen.active_pane().generating)
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert app.clipboard == "Reply to: first"
        engine.paused = False
        await idle(pilot, screen)


async def test_system_tool_gets_the_same_text_and_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tool, out = fake_tool(tmp_path)
    monkeypatch.setattr(clipboard, "clipboard_tool", lambda: tool)
    app, _ = make_app(tmp_path, chat_engine(script=code_reply))
    async with app.run_test(size=SIZE) as pilot:
        screen = await replied(pilot)
        shown = notices(monkeypatch, screen)
        await pilot.press("ctrl+t")
        await pilot.pause()
        assert app.clipboard == SECOND
        assert out.read_text() == SECOND
        assert shown == [("Copied 5 lines of python to the terminal clipboard and fakeclip", "information")]


class Recorder:
    clipboard = ""

    def copy_to_clipboard(self, text: str) -> None:
        self.clipboard = text


def test_a_failing_tool_is_not_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tool, out = fake_tool(tmp_path, exit_code=1)
    monkeypatch.setattr(clipboard, "clipboard_tool", lambda: tool)
    app = Recorder()
    assert copy_text(app, "ünïcode") == "terminal clipboard"
    assert app.clipboard == "ünïcode" and out.read_bytes() == "ünïcode".encode()


def test_a_missing_or_hanging_tool_never_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = ClipboardTool("gone", [str(tmp_path / "no-such-tool")])
    monkeypatch.setattr(clipboard, "clipboard_tool", lambda: missing)
    assert copy_text(Recorder(), "x") == "terminal clipboard"
    hanging = ClipboardTool("slow", [sys.executable, "-c", "import time; time.sleep(5)"])
    monkeypatch.setattr(clipboard, "clipboard_tool", lambda: hanging)
    monkeypatch.setattr(clipboard, "TOOL_TIMEOUT_S", 0.2)
    assert copy_text(Recorder(), "x") == "terminal clipboard"


def test_tool_lookup_follows_the_display(monkeypatch: pytest.MonkeyPatch) -> None:
    found = {"wl-copy": "/usr/bin/wl-copy", "xsel": "/usr/bin/xsel"}
    monkeypatch.setattr(clipboard.shutil, "which", found.get)
    assert clipboard.clipboard_tool() is None  # the env var says none
    monkeypatch.delenv(TOOL_ENV)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    monkeypatch.setenv("DISPLAY", ":0")
    assert clipboard.clipboard_tool() == ClipboardTool("xsel", ["/usr/bin/xsel", "--clipboard", "--input"])
    monkeypatch.setenv("WAYLAND_DISPLAY", "wayland-0")
    assert clipboard.clipboard_tool() == ClipboardTool("wl-copy", ["/usr/bin/wl-copy"])
    monkeypatch.delenv("WAYLAND_DISPLAY")
    monkeypatch.delenv("DISPLAY")
    if sys.platform != "darwin":
        assert clipboard.clipboard_tool() is None


# --- code blocks --------------------------------------------------------------------------------


def test_code_blocks_language_and_none() -> None:
    assert code_blocks(REPLY) == [CodeBlock("python", FIRST), CodeBlock("python", SECOND)]
    assert code_blocks("```\nls -l\n```") == [CodeBlock("", "ls -l")]
    assert code_blocks("```python title=x.py\npass\n```")[0].language == "python"
    assert code_blocks("no code, just `inline`") == []


def test_code_blocks_unclosed_fence_still_counts() -> None:
    cut = "Here:\n\n```rust\nfn main() {\n    println!("
    assert code_blocks(cut) == [CodeBlock("rust", "fn main() {\n    println!(")]


def test_code_blocks_tildes_and_nested_backticks() -> None:
    assert code_blocks("~~~sh\necho hi\n~~~") == [CodeBlock("sh", "echo hi")]
    nested = "````markdown\n```python\nx = 1\n```\n````"
    assert code_blocks(nested) == [CodeBlock("markdown", "```python\nx = 1\n```")]


def test_describe() -> None:
    assert describe("a\nb\nc", "python") == "Copied 3 lines of python"
    assert describe("a", "") == "Copied 1 line of code"
    assert describe("a\nb\nc") == "Copied the reply (3 lines)"
    assert CodeBlock("go", "a\nb").lines == 2
