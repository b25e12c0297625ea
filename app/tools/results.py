"""A tool's result as the `tool` message the model reads: text content joined, images, audio and
binary resources named (never inlined: a small model cannot read base64 and it fills the
context), errors as readable text, and everything cut to a limit with a note saying so."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

from mcp.types import CallToolResult


@dataclass(frozen=True)
class ToolResult:
    """What a call returned, ready to store as a `tool` message (`content`)."""

    content: str
    is_error: bool = False
    truncated: bool = False
    attachments: tuple[str, ...] = ()  # non-text parts, named: "image/png image, 12 kB"

    def message(self, tool_call_id: str, name: str | None = None) -> dict[str, Any]:
        """The OpenAI-style `tool` message answering the call `tool_call_id`."""
        out: dict[str, Any] = {"role": "tool", "tool_call_id": tool_call_id, "content": self.content}
        if name is not None:
            out["name"] = name
        return out


def error_result(text: str) -> ToolResult:
    """A call that failed before or outside the tool (refused, timed out, server gone)."""
    return ToolResult(f"Error: {text}", is_error=True)


def from_call_result(result: CallToolResult, max_chars: int) -> ToolResult:
    parts: list[str] = []
    named: list[str] = []
    for block in result.content:
        text, name = _block(block)
        if text is not None:
            parts.append(text)
        if name is not None:
            named.append(name)
            parts.append(f"[{name}: not shown]")
    if not result.content and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    text = "\n".join(parts) if parts else "(no output)"
    if result.is_error:
        text = text if text.lower().startswith("error") else f"Error: {text}"
    text, cut = cut_text(text, max_chars)
    return ToolResult(text, bool(result.is_error), cut, tuple(named))


def prompt_text(block: Any) -> str:
    """One MCP prompt message's content as text (non-text parts named)."""
    text, name = _block(block)
    return text if text is not None else f"[{name}: not shown]"


def cut_text(text: str, max_chars: int) -> tuple[str, bool]:
    """`text` cut to about `max_chars` at a line end, with a note of what was left out."""
    if len(text) <= max_chars:
        return text, False
    head = text[:max_chars]
    if "\n" in head[max_chars // 2:]:
        head = head[:head.rindex("\n")]
    left = text[len(head):]
    note = (f"\n[output cut: {len(left):,} more characters, {left.count(chr(10)):,} more lines not shown; "
            "ask for less, e.g. a smaller range or a narrower pattern]")
    return head + note, True


def _block(block: Any) -> tuple[str | None, str | None]:
    """(text to show, name of a part not shown) of one content block."""
    kind = getattr(block, "type", None)
    if kind == "text":
        return block.text, None
    if kind in ("image", "audio"):
        return None, f"{block.mime_type} {kind}, {_size(_decoded_len(block.data))}"
    if kind == "resource_link":
        return f"[resource {block.uri}{' (' + block.name + ')' if block.name else ''}]", None
    if kind == "resource":
        inner = block.resource
        if getattr(inner, "text", None) is not None:
            return f"[resource {inner.uri}]\n{inner.text}", None
        mime = getattr(inner, "mime_type", None) or "binary"
        return None, f"{mime} resource {inner.uri}, {_size(_decoded_len(getattr(inner, 'blob', '')))}"
    return None, f"{kind or type(block).__name__} content"


def _decoded_len(data: str) -> int:
    try:
        return len(base64.b64decode(data, validate=False))
    except (ValueError, TypeError):
        return len(data)


def _size(n: int) -> str:
    return f"{n} bytes" if n < 1000 else f"{n / 1000:.0f} kB" if n < 1_000_000 else f"{n / 1e6:.1f} MB"
