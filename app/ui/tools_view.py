"""Tools on screen: the approval card a call waits on in the chat, and the tools view (MCP servers,
their state and tools). Both are views: the approvals belong to the chat's `ChatTools`, the
servers' state to the app's `ToolManager`."""

from __future__ import annotations

import asyncio

from rich.syntax import Syntax
from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList, Static
from textual.widgets.option_list import Option

from app.tools.approval import Decision
from app.tools.manager import ServerState, ServerStatus, ToolManager
from app.tools.turn import CallCard

_ARGUMENTS_LINES = 12  # an argument list longer than this is cut on the card (the model sent it all)


class ApprovalCard(Vertical):
    """A tool call waiting for the user: server, tool, arguments (an edit's diff, in the file for
    the built-in server, and why it would fail where it would); enter runs it once, `a` always
    allows the tool in this chat, esc refuses. `answer` is the choice."""

    can_focus = True
    BINDINGS = [
        Binding("enter", "answer('once')", "Run once"),
        Binding("a", "answer('always')", "Always allow"),
        Binding("escape", "answer('refuse')", "Refuse"),
    ]

    def __init__(self, card: CallCard) -> None:
        super().__init__(classes="approval-card")
        self.card = card
        self.answer: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()

    def compose(self) -> ComposeResult:
        card = self.card
        yield Label(Text.assemble(("⚙ ", "bold"), (card.title, "bold"),
                                  ("  wants to run · enter: run once · a: always allow in this chat · esc: refuse",
                                   "dim")), classes="approval-title")
        if card.tool.description:
            yield Label(card.tool.description.splitlines()[0][:200], classes="approval-description", markup=False)
        if card.note:
            # Wrapped, not cut as a Label is: the reason is what the user acts on.
            yield Static(Text(f"⚠ If run, it fails: {card.note}"), classes="approval-note")
        lines = card.arguments_text().splitlines()
        if len(lines) > _ARGUMENTS_LINES:
            lines = lines[:_ARGUMENTS_LINES] + [f"… {len(lines) - _ARGUMENTS_LINES} more lines"]
        if card.diff is None:
            yield Static(Text("\n".join(lines)), classes="approval-arguments")
        else:
            yield Static(Text(f"{card.arguments.get('path', '')}", style="bold"), classes="approval-arguments")
            yield Static(Syntax(card.diff, "diff", theme="ansi_dark", word_wrap=True), classes="approval-diff")

    def action_answer(self, choice: str) -> None:
        if not self.answer.done():
            self.answer.set_result(Decision(choice))


class ToolsScreen(ModalScreen[None]):
    """The MCP servers with their state and one-line reason, and their tools with descriptions:
    enter (or space) turns the highlighted tool or server off or on, r restarts a server."""

    BINDINGS = [
        Binding("escape", "close", "Close"),
        Binding("space", "toggle", "On/off", show=False),
        Binding("r", "restart", "Restart server"),
    ]

    def __init__(self, manager: ToolManager | None, reason: str = "") -> None:
        super().__init__(classes="dialog-screen")
        self.manager = manager
        self._reason = reason  # why there is no manager (a bad config entry)

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog tools-view"):
            yield Label("MCP servers and tools · enter/space: on or off · r: restart the server · esc: close",
                        classes="dialog-question")
            yield OptionList(id="tools")

    def on_mount(self) -> None:
        self.refresh_rows()
        self.query_one(OptionList).focus()

    def refresh_rows(self) -> None:
        """Rebuild the rows from the manager's snapshot (it calls for this on every change)."""
        rows = self.query_one(OptionList)
        highlighted = rows.highlighted_option.id if rows.highlighted_option is not None else None
        rows.clear_options()
        if self.manager is None:
            rows.add_option(Option(self._reason or "Tools are off", id="none", disabled=True))
            return
        options = [option for status in self.manager.servers() for option in _rows(status)]
        if not options:
            options = [Option("No MCP servers are configured ([mcp_servers.NAME] in the config, or --mcp-config)",
                              id="none", disabled=True)]
        rows.add_options(options)
        ids = [o.id for o in options]
        if highlighted in ids:
            rows.highlighted = ids.index(highlighted)

    @on(OptionList.OptionSelected)
    def _selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.action_toggle()

    def _target(self) -> tuple[str, str | None] | None:
        """(server, tool or None) of the highlighted row."""
        option = self.query_one(OptionList).highlighted_option
        if option is None or self.manager is None or not option.id or option.id == "none":
            return None
        server, _, tool = option.id.partition("/")
        return server, tool or None

    def action_toggle(self) -> None:
        target = self._target()
        if target is None:
            return
        server, tool = target
        status = self.manager.server(server)
        if tool is None:
            self.manager.set_server_enabled(server, not status.enabled)
        else:
            info = next((t for t in status.tools if t.name == tool), None)
            if info is not None:
                self.manager.set_tool_enabled(server, tool, not info.enabled)

    def action_restart(self) -> None:
        target = self._target()
        if target is not None:
            self.manager.restart(target[0])
            self.notify(f"Restarting {target[0]}")

    def action_close(self) -> None:
        self.dismiss(None)


_MARKS = {ServerState.READY: ("●", "green"), ServerState.STARTING: ("◌", "yellow"),
          ServerState.FAILED: ("✗", "red"), ServerState.STOPPED: ("○", "grey50")}


def _rows(status: ServerStatus) -> list[Option]:
    """A row per server (its line, then its command line or URL) and per tool (the view's CSS keeps
    each line on one line, cut with …)."""
    mark, color = _MARKS[status.state] if status.enabled else ("○", "grey50")
    head = Text.assemble((f"{mark} ", color), (status.line(), "bold"))
    if status.target:
        head.append(f"\n    {status.target}", style="dim")
    out = [Option(head, id=status.name)]
    for tool in status.tools:
        line = Text.assemble(("    ✓ " if tool.enabled else "    ✗ ", "green" if tool.enabled else "red"),
                             (tool.name, "" if tool.enabled else "dim"))
        if tool.auto_approve:
            line.append(" (runs without asking)", style="dim")
        if tool.description:
            line.append(f" · {tool.description.splitlines()[0][:90]}", style="dim")
        out.append(Option(line, id=f"{status.name}/{tool.name}"))
    return out
