"""A chat's tools, without a screen: which tools its next reply is offered, and the round of calls
a reply ends with, run through `app.tools.turn.ToolLoop` (approval, the step limit, results as
`tool` messages). One per chat (its approvals and step count are the chat's); every chat shares
the app's `ToolManager`. The view answers `ask` (the approval card); tests give a function."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from app.engine.api.tool_use import ParsedCall
from app.tools.approval import ApprovalPolicy, Decision, StepLimit
from app.tools.manager import ToolInfo
from app.tools.results import ToolResult
from app.tools.turn import Ask, CallCard, ToolLoop


class ToolSource(Protocol):
    """What a chat needs of `ToolManager`."""

    def offered_tools(self) -> list[ToolInfo]: ...

    def find(self, offered: str) -> ToolInfo | None: ...

    async def call_async(self, offered: str, arguments: Mapping[str, Any] | None,
                         timeout: float | None = None) -> ToolResult: ...


async def refuse(card: CallCard) -> Decision:
    """The answer while no view asks (a chat not shown yet)."""
    return Decision.REFUSE


class ChatTools:
    """The `ToolRunner` a `ChatSession` calls (see session.py's docstring)."""

    def __init__(self, source: ToolSource, step_limit: int) -> None:
        self.source = source
        self.loop = ToolLoop(source, ApprovalPolicy(), StepLimit(step_limit))
        self.ask: Ask = refuse  # set by the view: shows the card, returns the user's answer
        self.limit_reached = False  # the last round was not run: the step limit stopped the loop
        self.cancelled = False  # the last round was cancelled (esc during a call)

    def offered(self) -> list[dict[str, Any]]:
        """The enabled tools of the ready servers, as OpenAI `tools` entries."""
        return [tool.openai() for tool in self.source.offered_tools()]

    def new_turn(self) -> None:
        """A user message: the step count starts again."""
        self.loop.new_turn()

    @property
    def limit_message(self) -> str:
        return self.loop.steps.message

    async def run(self, calls: Sequence[Mapping[str, Any]], cut: str | None = None) -> list[tuple[str, str, str]]:
        """(tool_call_id, name, content) per call, in order; none when the step limit stops the
        loop (`limit_reached`). A cancel (esc) ends the round: the calls not finished are answered
        as cancelled (`cancelled`), and the task goes on (the results are stored). `cut`: the
        reply's token limit ended its last call (`ToolLoop.run_one`)."""
        parsed = [ParsedCall(c.get("id") or "", c["function"]["name"], c["function"].get("arguments") or "")
                  for c in calls]
        messages = await self.loop.run(parsed, self.ask, cut)
        self.limit_reached, self.cancelled = messages is None, self.loop.cancelled
        return [(m["tool_call_id"], m["name"], m["content"]) for m in messages or []]
