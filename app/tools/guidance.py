"""What a chat with tools tells the model about using them: a short system message, in front of
the chat's own system prompt, whenever tools are offered. The app's chat tabs (local or remote
engine) and the tool benchmark (every mode, an OpenAI server's too) send the same text.

Why: with only the chat template's tool section, small models describe the call they would make
("you can use the files__search function ...") or guess instead of calling (docs/tools.md,
Benchmark). The HTTP endpoint does not add it: its clients bring their own instructions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from app.tools.config import BUILTIN_NAME

# A call the user cancelled (esc while it ran): an error to the model, not the tool's failure.
CANCELLED_TEXT = "Error: the user cancelled this call before it finished."
# A built-in read made again right after itself (`ToolLoop.repeats`): not run, and not a failure.
# How a call the reply's token limit cut is answered (`cut_call_cause`): not forced again under the
# same limit.
CUT_CALL = "the call was cut at"
REPEATED_TEXT = ("Error: you made this call just before and its result, above, has not changed; answer from it, "
                 "or make a different call.")

# With the built-in code tools (`files__...`) offered. Measured against other wordings on the
# benchmark's tasks (docs/tools.md): naming the `<tool_call>` block and "no explanation before it"
# is what made Qwen2.5-Coder 1.5B call instead of describing the call.
CODE_GUIDANCE = ("You are a coding assistant. You see the user's project, the working directory, only through "
                 "your tools, and you run them yourself: the user cannot. To answer a question about the code, "
                 "start your reply with a <tool_call> block right away, with no explanation before it; read the "
                 "result, and call again if you need more. Never describe a call instead of making it, and never "
                 "guess what a file contains. Call one tool at a time. After a result, answer the user's question "
                 "from it: never describe the result or your call. When you have the answer, reply in one or two "
                 "short sentences.\n"
                 "Paths are relative to the working directory: search finds where something is, read_file reads "
                 "a file, list_files lists them. Change a file only with apply_edit, and only when asked.")
# With other tools only.
GUIDANCE = ("You are an assistant with tools, and you run them yourself: the user cannot. When a question "
            "needs a tool, start your reply with a <tool_call> block right away, with no explanation before it; "
            "read the result, and call again if you need more. Never describe a call instead of making it, and "
            "never guess what a tool would return. Call one tool at a time. After a result, answer the user's "
            "question from it: never describe the result or your call. When you have the answer, reply in one or "
            "two short sentences.")


def tools_guidance(tools: Sequence[Mapping[str, Any]]) -> str:
    """The guidance for offering `tools` (OpenAI `tools` entries); "" when none are offered."""
    if not tools:
        return ""
    code = any(t["function"]["name"].startswith(f"{BUILTIN_NAME}__") for t in tools)
    return CODE_GUIDANCE if code else GUIDANCE


def with_guidance(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with the guidance for `tools` at the head of their system prompt (a system
    message first when they have none); unchanged when no tools are offered."""
    out = [dict(m) for m in messages]
    guidance = tools_guidance(tools)
    if not guidance:
        return out
    if out and out[0].get("role") == "system":
        own = str(out[0].get("content") or "").strip()
        out[0]["content"] = f"{guidance}\n\n{own}" if own else guidance
    else:
        out.insert(0, {"role": "system", "content": guidance})
    return out


def next_tool_choice(messages: Sequence[Mapping[str, Any]]) -> str:
    """The tool_choice of the reply that follows `messages`: "required" right after a round of
    calls that all failed (a tool's error; not the user's refusal or cancel, a repeated read, nor a
    call the token limit cut, which a forced call under the same limit would repeat), unless the round
    before it failed too; else "auto". Why: told that a guessed path does not exist, small models
    describe the search they would make instead of making it (docs/tools.md); once per streak,
    so a tool that keeps failing does not hold the model in calls."""
    last = _last_round(messages, len(messages))
    if not last or not all(_failed(m) for m in last):
        return "auto"
    before = _last_round(messages, len(messages) - len(last) - 1)
    return "auto" if before and all(_failed(m) for m in before) else "required"


def _last_round(messages: Sequence[Mapping[str, Any]], end: int) -> list[Mapping[str, Any]]:
    """The `tool` messages that end `messages[:end]` (those answering one reply's calls)."""
    start = end
    while start > 0 and messages[start - 1].get("role") == "tool":
        start -= 1
    return list(messages[start:end])


def _failed(message: Mapping[str, Any]) -> bool:
    content = str(message.get("content") or "")
    return content.startswith("Error") and not content.startswith((CANCELLED_TEXT, REPEATED_TEXT, f"Error: {CUT_CALL}"))


def cut_call_cause(max_tokens: int | None) -> str:
    """Why a call its reply's token limit ended does not run, naming the cap (the model reads it
    as the call's error, the chat shows it)."""
    limit = f"the {max_tokens}-token limit of a reply" if max_tokens else "the end of the context"
    return f"{CUT_CALL} {limit}"
