"""Export a chat to a Markdown file."""

from __future__ import annotations

import re
from pathlib import Path
from types import MappingProxyType

from app.engine.types.errors import LocalbatchError
from app.ui.store import ChatRecord, MessageRecord

_ROLE_TITLES = MappingProxyType({"user": "User", "assistant": "Assistant", "tool": "Tool"})


def chat_to_markdown(chat: ChatRecord, messages: list[MessageRecord], model_name: str = "") -> str:
    lines = [f"# {chat.title}", ""]
    meta = f"model {model_name} · {chat.settings.summary()}" if model_name else chat.settings.summary()
    lines += [f"*{meta}*", ""]
    if chat.system_prompt.strip():
        lines += ["## System", "", chat.system_prompt.strip(), ""]
    for message in messages:
        lines += [f"## {_title(message, model_name)}", ""]
        lines += [message.content.rstrip(), ""] if message.content.strip() or not message.tool_calls else []
        lines += _calls(message)
        if message.finish_reason in ("abort", "length", "error"):
            lines += [f"*(reply ended: {message.finish_reason})*", ""]
    return "\n".join(lines)


def _title(message: MessageRecord, model_name: str) -> str:
    title = _ROLE_TITLES.get(message.role, message.role)
    if message.role == "tool" and message.name:
        title += f" `{message.name}`"
    if message.model and message.model != model_name:  # written before a model switch
        title += f" ({message.model})"
    return title


def _calls(message: MessageRecord) -> list[str]:
    """An assistant's tool calls, one line each: the tool and its arguments as the model wrote them."""
    calls = [call.get("function") or {} for call in message.tool_calls or []]
    lines = [f"- calls `{f.get('name', '?')}` with `{f.get('arguments', '')}`" for f in calls]
    return lines + [""] if lines else []


def slugify(title: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")
    return slug[:48] or "chat"


def export_chat(
    chat: ChatRecord, messages: list[MessageRecord], directory: Path, model_name: str = ""
) -> Path:
    """Write `<directory>/<title-slug>-<id>.md` (overwriting an earlier export) and return its path."""
    path = Path(directory) / f"{slugify(chat.title)}-{chat.id}.md"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(chat_to_markdown(chat, messages, model_name), encoding="utf-8")
    except OSError as e:
        raise LocalbatchError(f"cannot export chat to {path}: {e.strerror or e}") from None
    return path
