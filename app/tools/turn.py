"""One round of tool calls in a chat, after the model's turn ended with calls: each call is shown
to the user (a `CallCard`) unless it may run without asking, runs or is refused, and comes back
as the `tool` message that answers it. The chat session drives it; the UI only answers `ask`.

    loop = ToolLoop(manager, ApprovalPolicy(), StepLimit(config.step_limit))
    loop.new_turn()                                     # on each user message
    messages = await loop.run(parser.calls, ask)        # ask(card) -> Decision, shown by the UI
    # None: the step limit is reached (loop.steps.message says so); else the tool messages"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from app.engine.api.tool_use import ParsedCall
from app.tools.approval import REFUSED_TEXT, ApprovalPolicy, Decision, StepLimit
from app.tools.edits import unified_diff
from app.tools.errors import ToolInputError, refusal_line
from app.tools.guidance import CANCELLED_TEXT, REPEATED_TEXT
from app.tools.manager import ToolInfo
from app.tools.results import ToolResult, error_result
from app.tools.workdir import Workdir


class ToolRunner(Protocol):
    """What the loop needs of `ToolManager` (tests give a stand-in)."""

    def find(self, offered: str) -> ToolInfo | None: ...

    async def call_async(self, offered: str, arguments: Mapping[str, Any] | None,
                         timeout: float | None = None) -> ToolResult: ...


@dataclass(frozen=True)
class CallCard:
    """A call as the approval card shows it."""

    call: ParsedCall
    tool: ToolInfo
    arguments: dict[str, Any]
    diff: str | None = None  # an edit's change, for apply_edit-like tools
    note: str | None = None  # why the edit, run, would fail (the diff is then only its arguments')

    @property
    def title(self) -> str:
        return f"{self.tool.server} · {self.tool.name}"

    def arguments_text(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False, indent=2)


Ask = Callable[[CallCard], Awaitable[Decision]]


class ToolLoop:
    def __init__(self, tools: ToolRunner, policy: ApprovalPolicy | None = None,
                 steps: StepLimit | None = None) -> None:
        self.tools = tools
        self.policy = policy or ApprovalPolicy()
        self.steps = steps or StepLimit()
        self.last_reads: list[tuple[str, str]] = []  # the last round, when it was only built-in reads
        self.cancelled = False  # the last round was cancelled (its awaiting task, during a call)

    def new_turn(self) -> None:
        """A user message: the step count starts again, and no round is repeated yet."""
        self.steps.reset()
        self.last_reads = []

    def repeats(self, calls: Sequence[ParsedCall]) -> bool:
        """Whether `calls` are the built-in tools' reads (list, read, search) of the round just
        before, again: no edit came between, so their result is the one above (a small model
        kept from ending its reply repeats its last call instead). Records this round."""
        keys = [(call.name, _canonical(call.arguments)) for call in calls]
        reads = all(_builtin_read(self.tools.find(call.name)) for call in calls)
        again = reads and keys == self.last_reads
        self.last_reads = keys if reads else []
        return again

    async def run(self, calls: Sequence[ParsedCall], ask: Ask, cut: str | None = None) -> list[dict[str, Any]] | None:
        """The `tool` messages answering `calls`, in order; None when the step limit stops the loop
        (nothing runs). Cancelling the awaiting task during a call cancels that call and ends the
        round: the calls not finished are answered as cancelled (`cancelled`), and the task goes
        on. `cut`: the reply's token limit ended its last call (`run_one`)."""
        self.cancelled = False
        if not calls:
            return []
        if not self.steps.take():
            return None
        if self.repeats(calls):
            return [ToolResult(REPEATED_TEXT, is_error=True).message(call.id, call.name) for call in calls]
        out = []
        for i, call in enumerate(calls):
            if not self.cancelled:
                try:
                    out.append(await self.run_one(call, ask, cut if i == len(calls) - 1 else None))
                    continue
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if task is not None:
                        task.uncancel()
                    self.cancelled = True
            out.append(ToolResult(CANCELLED_TEXT, is_error=True).message(call.id, call.name))
        return out

    async def run_one(self, call: ParsedCall, ask: Ask, cut: str | None = None) -> dict[str, Any]:
        """One call of a round `steps.take()` admitted: asked, run or refused; its `tool` message.
        `cut`: the reply's token limit ended this call (`guidance.cut_call_cause`); said, with what
        to do, instead of the JSON error when its arguments did not get to be whole."""
        tool = self.tools.find(call.name)
        if tool is None:
            return error_result(f"there is no tool named {call.name!r}").message(call.id, call.name)
        try:
            arguments = json.loads(call.arguments or "{}")
        except ValueError:
            if cut is not None:
                return error_result(f"{cut}; write a shorter call").message(call.id, call.name)
            arguments = None
        if not isinstance(arguments, dict):
            return error_result("the arguments are not a JSON object").message(call.id, call.name)
        if self.policy.needs_asking(tool):
            decision = await ask(CallCard(call, tool, arguments, *await card_preview(tool, arguments)))
            if not self.policy.decide(tool, decision):
                return ToolResult(REFUSED_TEXT, is_error=True).message(call.id, call.name)
        result = await self.tools.call_async(call.name, arguments)
        return result.message(call.id, call.name)


def _builtin_read(tool: ToolInfo | None) -> bool:
    return tool is not None and tool.root is not None and tool.name != "apply_edit"


def _canonical(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments or "{}"), sort_keys=True)
    except ValueError:
        return arguments


def edit_preview(arguments: Mapping[str, Any]) -> str | None:
    """The change an edit call asks for, as a diff: its `diff`, or its search/replace as one."""
    diff, search, replace = arguments.get("diff"), arguments.get("search"), arguments.get("replace")
    if isinstance(diff, str) and diff.strip():
        return diff
    if isinstance(search, str) and isinstance(replace, str):
        return unified_diff(str(arguments.get("path", "file")), search, replace) or None
    return None


async def card_preview(tool: ToolInfo, arguments: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(diff, note) for a call's card. The built-in server's `apply_edit`: the change in the file,
    read on a worker thread (the loop awaiting this is the UI's); any other tool: `edit_preview`."""
    if tool.root is None or tool.name != "apply_edit":
        return edit_preview(arguments), None
    return await asyncio.to_thread(file_preview, tool.root, arguments)


def file_preview(root: str, arguments: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(diff, note): the diff `apply_edit` would apply to the file under `root` (the server's own
    edit, not written), or, where it would fail, its error as one line and `edit_preview`."""
    path, search, replace, diff = (arguments.get(k) for k in ("path", "search", "replace", "diff"))
    if not isinstance(path, str) or not all(v is None or isinstance(v, str) for v in (search, replace, diff)):
        return edit_preview(arguments), None  # the server refuses these arguments' types itself
    try:
        return Workdir.open(root).preview_edit(path, search, replace, diff), None
    except (ToolInputError, OSError) as e:
        return edit_preview(arguments), refusal_line(e)
