"""Whether a tool call runs, asked of the user and remembered for the chat; and the step limit
that ends a runaway loop of calls. Both belong to one chat and know nothing of the UI: the UI
shows the card for `ApprovalPolicy.needs_asking` calls and reports the answer with `decide`."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from app.tools.config import DEFAULT_STEP_LIMIT
from app.tools.manager import ToolInfo


class Decision(enum.Enum):
    ONCE = "once"  # run this call (enter)
    ALWAYS = "always"  # run it, and every later call of this tool in this chat (a)
    REFUSE = "refuse"  # do not run it; the model is told (esc)


REFUSED_TEXT = "The user refused this tool call. Do not retry it; ask or answer without it."


@dataclass
class ApprovalPolicy:
    """One chat's approvals: config `auto_approve` tools and those allowed "always" here run
    without asking; everything else asks."""

    always: set[str] = field(default_factory=set)  # offered names allowed for the rest of the chat

    def needs_asking(self, tool: ToolInfo) -> bool:
        return not (tool.auto_approve or tool.offered_name in self.always)

    def decide(self, tool: ToolInfo, decision: Decision) -> bool:
        """Record the user's answer; True when the call runs."""
        if decision is Decision.ALWAYS:
            self.always.add(tool.offered_name)
        return decision is not Decision.REFUSE


@dataclass
class StepLimit:
    """Model turns that end in tool calls, counted from the user's last message; past `limit`
    the chat stops the loop and says why."""

    limit: int = DEFAULT_STEP_LIMIT
    steps: int = 0

    def reset(self) -> None:
        """A new user message starts a new count."""
        self.steps = 0

    def take(self) -> bool:
        """Count one more round of calls; False when it is over the limit (do not run it)."""
        self.steps += 1
        return self.steps <= self.limit

    @property
    def message(self) -> str:
        return (f"Stopped after {self.limit} tool steps in a row (the step limit); "
                "send a message to let the model go on.")
