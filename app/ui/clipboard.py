"""Copying to the clipboard: a reply, a code block of one, or any message.

The text goes to the terminal's clipboard (OSC 52, through `App.copy_to_clipboard`: works over SSH
and inside tmux with `set-clipboard on`) and also to the system clipboard when a tool for it is
found (wl-copy, xclip, xsel, pbcopy, clip.exe): a terminal without OSC 52 still gets it locally."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Protocol

from markdown_it import MarkdownIt

TOOL_ENV = "LOCALBATCH_CLIPBOARD_TOOL"  # "none": never use a system tool (the tests set it)
TOOL_TIMEOUT_S = 2.0

_MARKDOWN = MarkdownIt("commonmark")


@dataclass(frozen=True)
class CodeBlock:
    language: str  # the fence's info string, first word; "" when none
    code: str  # without the closing newline: pasted into a shell, it runs nothing by itself

    @property
    def lines(self) -> int:
        return len(self.code.splitlines())


def code_blocks(markdown: str) -> list[CodeBlock]:
    """The fenced code blocks of a reply, in order; a reply cut off inside a fence still has it."""
    blocks = []
    for token in _MARKDOWN.parse(markdown):
        if token.type == "fence":
            words = token.info.split()
            blocks.append(CodeBlock(words[0] if words else "", token.content.removesuffix("\n")))
    return blocks


@dataclass(frozen=True)
class ClipboardTool:
    name: str  # what the notice says
    argv: list[str]
    encoding: str = "utf-8"


def clipboard_tool() -> ClipboardTool | None:
    """The system clipboard's command-line tool here, if any (one function: tests replace it)."""
    if os.environ.get(TOOL_ENV, "").lower() == "none":
        return None
    candidates: list[ClipboardTool] = []
    if os.environ.get("WAYLAND_DISPLAY"):
        candidates.append(ClipboardTool("wl-copy", ["wl-copy"]))
    if os.environ.get("DISPLAY"):
        candidates += [ClipboardTool("xclip", ["xclip", "-selection", "clipboard"]),
                       ClipboardTool("xsel", ["xsel", "--clipboard", "--input"])]
    if sys.platform == "darwin":
        candidates.append(ClipboardTool("pbcopy", ["pbcopy"]))
    # clip.exe (Windows, and WSL through the Windows PATH) reads UTF-16 with a BOM as Unicode.
    candidates.append(ClipboardTool("clip.exe", ["clip.exe"], "utf-16"))
    if sys.platform == "win32":
        candidates.append(ClipboardTool("clip", ["clip"], "utf-16"))
    for tool in candidates:
        path = shutil.which(tool.argv[0])
        if path:
            return ClipboardTool(tool.name, [path, *tool.argv[1:]], tool.encoding)
    return None


def _run_tool(tool: ClipboardTool, text: str) -> bool:
    """Whether the tool took the text: a failing tool is skipped, never an error."""
    try:
        done = subprocess.run(tool.argv, input=text.encode(tool.encoding), timeout=TOOL_TIMEOUT_S,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.SubprocessError, ValueError):
        return False
    return done.returncode == 0


class _Copier(Protocol):
    def copy_to_clipboard(self, text: str) -> None: ...


def copy_text(app: _Copier, text: str) -> str:
    """Copy to the terminal's clipboard and the system one; returns where it went, for the notice."""
    app.copy_to_clipboard(text)
    tool = clipboard_tool()
    if tool is not None and _run_tool(tool, text):
        return f"terminal clipboard and {tool.name}"
    return "terminal clipboard"


@dataclass(frozen=True)
class Copyable:
    """One thing the copy picker offers: a whole message or one code block of a reply."""

    text: str
    language: str | None = None  # a code block's ("" when the fence names none); None: a message
    what: str = "the reply"  # a message, as the notice names it

    def notice(self, where: str) -> str:
        return f"{describe(self.text, self.language, self.what)} to the {where}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"


def describe(text: str, language: str | None = None, what: str = "the reply") -> str:
    """The notice's first words: a code block by its size and language, anything else by `what`."""
    lines = _count(len(text.splitlines()), "line")
    if language is None:
        return f"Copied {what} ({lines})"
    return f"Copied {lines} of {language or 'code'}"
