"""MCP servers' prompts as `/name` in the chat input: tab completes the name, and a message that
starts with one is replaced by the prompt's text before it is sent.

    /review path=calc.py      arguments as key=value words
    /review calc.py           a prompt with one argument takes the rest of the line"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from typing import Any

from app.tools.manager import PromptInfo


def complete_prompt(partial: str, prompts: Sequence[PromptInfo]) -> tuple[str, list[str]]:
    """`partial` (the name typed after `/`) completed as far as the names agree, and the names."""
    options = sorted({p.name for p in prompts if p.name.startswith(partial)})
    if len(options) == 1:
        return options[0], options
    return os.path.commonprefix(options) or partial, options


def find_prompt(text: str, prompts: Sequence[PromptInfo]) -> tuple[PromptInfo, dict[str, str]] | None:
    """The prompt a message names (`/name args`) and its arguments; None: a plain message.
    Raises `ValueError` naming a required argument not given."""
    if not text.startswith("/"):
        return None
    name, _, rest = text[1:].strip().partition(" ")
    prompt = next((p for p in prompts if p.name == name), None)
    if prompt is None:
        return None
    rest = rest.strip()
    try:
        words = shlex.split(rest)
    except ValueError:
        words = rest.split()
    if words and all("=" in w for w in words):
        arguments = dict(w.split("=", 1) for w in words)
    elif rest and len(prompt.arguments) == 1:
        arguments = {prompt.arguments[0][0]: rest}
    else:
        arguments = {}
    missing = [a for a, required in prompt.arguments if required and a not in arguments]
    if missing:
        usage = " ".join(f"{a}=…" for a, _ in prompt.arguments)
        raise ValueError(f"/{prompt.name} needs {', '.join(missing)}: /{prompt.name} {usage}")
    return prompt, arguments


def prompt_message(messages: Sequence[dict[str, Any]]) -> str:
    """A prompt's messages as the one message the user sends (their texts, in order)."""
    return "\n\n".join(str(m.get("content") or "").strip() for m in messages if str(m.get("content") or "").strip())
