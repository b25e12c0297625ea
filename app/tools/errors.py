"""The tools' exceptions; each message is one line a user, or the model, can act on."""

from __future__ import annotations

from app.engine.types.errors import LocalbatchError


class ToolInputError(LocalbatchError):
    """A call the tool refuses: a path outside the working directory, a missing or binary file,
    a bad pattern or edit."""


class ToolConfigError(LocalbatchError):
    """An MCP server entry in the config or an mcp.json that cannot be used."""


class ToolCallError(LocalbatchError):
    """A call that could not be made or did not finish: unknown or disabled tool, server not
    ready, timeout, the server died."""


def refusal_line(e: BaseException) -> str:
    """A refused call's error as the model reads it (and an edit's card shows it): its first line."""
    return str(e).splitlines()[0] if str(e) else type(e).__name__
