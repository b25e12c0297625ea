"""One chat tab: a view of a `ChatSession` (its messages, the prompt input, the settings line,
the context meter) and the task that streams a reply into it.

The reply is consumed by an asyncio task in the app's own loop (a Textual worker running
`ChatSession.respond`): the engine's `stream()` yields one delta per engine step into a buffer,
and the screen's frame clock paints the shown tab's reply at most `FRAME_HZ` times a second
(`reply_stream`), so neither a cross-thread call nor a repaint happens per token."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.message import Message
from textual.widgets import TabPane
from textual.worker import Worker, WorkerCancelled, WorkerFailed

from app.engine.types.errors import LocalbatchError
from app.tools.approval import Decision
from app.tools.manager import PromptInfo
from app.tools.turn import CallCard
from app.ui.attach import display_text, options_hint, split_message
from app.ui.format import first_line
from app.ui.message_list import MessageList, meta_line, shown
from app.ui.reply_stream import DELTA_MAX_DELAY_S, FinalRenders, ReplyWriter
from app.ui.session.prompts import find_prompt, prompt_message
from app.ui.session.reply import Reply, ReplyEnd, ReplySink
from app.ui.session.session import ATTACHMENTS, SETTINGS, ChatSession
from app.ui.settings_view import ChatSettingsView
from app.ui.store import MessageRecord
from app.ui.tools_view import ApprovalCard
from app.ui.widgets import (
    AttachmentsLine,
    ContextMeter,
    MessageView,
    PromptInput,
)


def cache_hit_text(hit: tuple[int, int, int] | None) -> str:
    """The reply footer's prefix-cache figure: " · prefix cache 3,536 / 3,562 prompt tok (3,520 from disk)"."""
    if not hit:
        return ""
    cached, prompt, disk = hit
    return f" · prefix cache {cached:,} / {prompt:,} prompt tok" + (f" ({disk:,} from disk)" if disk else "")

class ChatPane(TabPane):
    """A tab holding one conversation; while it generates it is one sequence in the engine."""

    BINDINGS = [
        Binding("shift+pageup", "scroll_history(-1)", "Scroll up", show=False),
        Binding("shift+pagedown", "scroll_history(1)", "Scroll down", show=False),
    ]

    class Changed(Message):
        """Title or generating state changed (the screen relabels the tab)."""

        def __init__(self, pane: ChatPane) -> None:
            super().__init__()
            self.pane = pane

    def __init__(self, session: ChatSession, color: str, settings_key: str = "f3",
                 renders: FinalRenders | None = None) -> None:
        super().__init__(session.chat.title, id=f"chat-{session.chat.id}")
        self.session = session
        session.on_change = self._session_changed
        self.color = color
        self._settings_key = settings_key
        # Not focusable: a focusable history took the focus for a moment on every tab switch (the
        # shown tab's first focusable), and restyling its ~130 widgets on focus and again on blur
        # was most of the switch. The wheel scrolls it; keys: shift+pageup / shift+pagedown.
        self.message_list = MessageList(lambda: session.messages, classes="messages", can_focus=False)
        self.prompt = PromptInput(recall=session.recall_prompts, prompts=lambda: mcp_prompts(self), classes="prompt")
        self.settings = ChatSettingsView(session, settings_key, self.focus_input)
        self.renders = renders or FinalRenders()  # the app's, shared by its tabs
        self.live: LiveReply | None = None  # the reply being generated
        self._worker: Worker | None = None
        self._meter_timer = None

    @property
    def generating(self) -> bool:
        return self.session.generating

    def tab_label(self) -> Text:
        """The title, then a dot in the tab's colour while it generates (a blank of the same width
        otherwise: a reply starting or ending then moves no tab, see `screen.relabel`)."""
        label = Text(self.session.chat.title)
        label.append(" ●" if self.generating else "  ", style=self.color)
        return label

    # layout

    def compose(self) -> ComposeResult:
        yield self.settings
        # The history is mounted when the tab is first shown, newest page first (see MessageList).
        yield self.message_list
        yield AttachmentsLine(classes="attachments")
        yield self.prompt
        yield ContextMeter(classes="context-meter")

    def action_scroll_history(self, pages: int) -> None:
        scroll = self.message_list
        (scroll.scroll_page_down if pages > 0 else scroll.scroll_page_up)(animate=False)

    def on_mount(self) -> None:
        # Anchored: follows new output only while the view is at the bottom.
        self.message_list.anchor()

    async def on_show(self) -> None:
        self.message_list.ensure_shown()
        if not self.session.context.counted_yet:
            self.refresh_meter(recount=True)
        await self.renders.shown(self.id)  # replies that ended while it was hidden
        await self.paint_reply()  # a tab shown mid-reply paints what it buffered while hidden

    def _session_changed(self, what: str) -> None:
        if what == ATTACHMENTS:
            if self.is_attached:
                self.query_one(AttachmentsLine).show_files(self.session.draft.attachments)
            self.refresh_meter()
            return
        if what == SETTINGS and self.is_attached:
            self.settings.settings_changed()
        if what != SETTINGS:  # TITLE, GENERATING: the screen relabels the tab
            self.post_message(self.Changed(self))

    async def paint_reply(self) -> None:
        """Paint what the reply buffered since the last paint; the screen's frame clock calls this
        for the tab that is shown (a hidden tab keeps buffering)."""
        if self.live is not None and self.display:
            await self.live.paint()

    def focus_input(self) -> None:
        self.prompt.focus()

    # the input and the meter under it

    def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        """Send the input; one that starts with an MCP prompt's `/name` is that prompt's text,
        fetched from its server first (the input stays until it comes)."""
        event.stop()
        try:
            found = find_prompt(self.prompt.text.strip(), mcp_prompts(self))
        except ValueError as e:
            self.app.notify(str(e), title="Not sent", severity="warning")
            return
        if found is None:
            self.send_input()
            return
        prompt, arguments = found

        async def expand() -> None:
            try:
                messages = await asyncio.wrap_future(self.app.tools.get_prompt(prompt.server, prompt.name, arguments))
            except LocalbatchError as e:
                self.app.notify(str(e), title="Not sent", severity="error")
                return
            if self.send(prompt_message(messages)):
                self.prompt.clear()

        self.run_worker(expand(), group="mcp-prompt")


    def on_text_area_changed(self, event: PromptInput.Changed) -> None:
        if isinstance(event.text_area, PromptInput):
            # Counted once typing pauses: a pasted file is tokenized once, not per keystroke.
            if self._meter_timer is not None:
                self._meter_timer.stop()
            self._meter_timer = self.set_timer(0.3, self.refresh_meter)

    def on_prompt_input_completions(self, event: PromptInput.Completions) -> None:
        event.stop()
        self.query_one(ContextMeter).show_hint(options_hint(event.options, 12))

    def refresh_meter(self, recount: bool = False) -> None:
        """Repaint the line under the input: the chat's tokens against the context, and what the
        message being written adds and costs to read at the engine's measured prefill rate."""
        self._meter_timer = None
        if not self.is_attached:
            return
        session, meter = self.session, self.query_one(ContextMeter)
        try:
            used, adding = session.chat_tokens(recount), session.draft_tokens(self.prompt.text.strip())
        except LocalbatchError as e:  # a template the engine cannot render, a closed engine: said, not raised
            meter.show_hint(f"cannot count this chat's tokens: {first_line(e)}")
            return
        budget = session.context
        meter.show_usage(used, adding, budget.context, budget.kv_pool_tokens, budget.prefill_rate,
                         approximate=budget.approximate, left_out=session.left_out_messages())
        warning = budget.full_warning(session.chat.title, session.chat.settings, self._settings_key)
        if warning:
            self.app.notify(warning, title="Context", severity="warning", timeout=10)

    def load_message(self, content: str) -> None:
        """A stored user message into the input: its files as attachments, its text to edit."""
        files, text = split_message(content)
        self.prompt.load_text(text)
        self.session.draft.set_attachments(files)
        self.refresh_meter(recount=True)
        self.focus_input()

    # sending, regenerating, taking a turn back, stopping

    def send_input(self) -> bool:
        if self.send(self.prompt.text):
            self.prompt.clear()
            return True
        return False

    def send(self, text: str) -> bool:
        """Add a user message (the attached files first) and start the reply; False (nothing sent,
        the input kept) while a reply is running, or when a file or the context says no (a notice)."""
        text = text.strip()
        if not text or self.generating:
            return False
        try:
            content, plan = self.session.prepare_message(text)
        except LocalbatchError as e:
            self.app.notify(str(e), title="Not sent", severity="error", timeout=12)
            return False
        self.message_list.ensure_shown()  # a broadcast may reach a tab that was never shown
        self.session.add_user_message(text, content, plan)
        self._start(*self.message_list.mount_turn(display_text(content)))
        return True

    def regenerate(self) -> bool:
        """Drop the last reply (if any) and generate it again from the same history."""
        if self.generating or not self.session.messages:
            return False
        try:
            self.session.prepare_regenerate()
        except LocalbatchError as e:
            self.app.notify(str(e), title="Not regenerated", severity="error", timeout=12)
            return True  # said: nothing more to say
        self.message_list.ensure_shown()
        views = self.message_list.remove_last(len(self.session.drop_last_replies()))
        self._start(*self.message_list.mount_reply(views))
        return True

    def take_back_last_turn(self) -> bool:
        """Remove the last user message and the replies after it, from the store and the view, and
        put the message (its files as attachments) back in the input to edit and resend. False
        while a reply runs or when there is no user message."""
        if self.generating:
            return False
        self.message_list.ensure_shown()
        taken = self.session.take_back_last_turn()
        if not taken:
            return False
        self.message_list.remove_last(len(taken))
        self.load_message(taken[0].content)
        return True

    def _start(self, view: MessageView, mounted: Awaitable[None]) -> None:
        """Start the reply into `view`, a view being `mounted`."""
        self.message_list.release_reply_space()
        self.message_list.drop_failed_views()  # the new reply replaces an earlier attempt's error
        reply = self.session.begin_reply()
        self.live = LiveReply(self, view, mounted)
        if self.session.tool_runner is not None:
            self.session.tool_runner.ask = self.live.ask
        work = self.session.respond(reply, self.live, DELTA_MAX_DELAY_S)
        self._worker = self.run_worker(work, group="generate", exit_on_error=False)

    def stop(self) -> bool:
        """Stop the reply; during a round of tool calls, cancel the call running (the model is told)."""
        if not self.session.stop():
            return False
        if (self.session.running_tools or self.session.reply.streaming) and self._worker is not None:
            self._worker.cancel()
        return True

    async def stop_and_wait(self) -> None:
        """Stop the reply (if any) and wait until its partial text is committed."""
        worker = self._worker
        self.stop()
        if worker is not None:
            try:
                await worker.wait()
            except (WorkerCancelled, WorkerFailed):
                pass  # cancelled before it ran, or failed: either way nothing is left to commit


class LiveReply:
    """The view's side of the reply being generated (the session's `ReplyView`): its
    `MessageView`, the writer that buffers its text for the frame clock, and the line under it
    while its prompt is read."""

    def __init__(self, pane: ChatPane, view: MessageView, mounted: Awaitable[None]) -> None:
        self._pane = pane
        self._view = view
        self._mounted = mounted
        self._reply: Reply | None = None
        self._writer: ReplyWriter | None = None
        self._reading = ""  # the prompt's progress line shown under the reply, until its first token

    async def opened(self, reply: Reply) -> ReplySink:
        if self._reply is not None:  # the reply after a round of tool calls: a view of its own
            self._view, self._mounted = self._pane.message_list.mount_reply([])
            self._pane.live = self
        await self._mounted
        self._reply = reply
        self._writer = ReplyWriter(self._view.markdown, self._view.stream)
        self._pane.renders.started()
        return self._writer

    async def paint(self) -> None:
        if self._writer is None:
            return
        if self._reading and self._reply.metrics.num_tokens:
            self.show_reading("")
        await self._writer.flush()

    def show_reading(self, line: str) -> None:
        """Show the prompt's progress under the reply ("" clears it); only before its first token,
        and only when the line changes (the panels poll once a second)."""
        if self._writer is None or line == self._reading or (line and self._reply.metrics.num_tokens):
            return
        self._reading = line
        self._view.set_meta(line)

    async def closing(self, reply: Reply, end: ReplyEnd) -> None:
        writer, self._writer, self._reading = self._writer, None, ""
        self._pane.message_list.hold_reply_space(self._view)
        # Tool calls are shown by `closed` at once; a plain reply in a hidden tab may wait.
        shown = self._pane.display or bool(end.tool_calls)
        await self._pane.renders.ended(self._pane.id, writer, self._view.markdown, shown)

    def closed(self, reply: Reply, message: MessageRecord | None, end: ReplyEnd) -> None:
        view, session = self._view, self._pane.session
        if end.error:
            view.set_meta(f"error: {end.error}", error=True)
            view.set_class(message is None, "failed")
        elif message is not None:
            metrics = reply.metrics
            hit = cache_hit_text(reply.cache_hit)
            dropped = session.left_out_messages()
            left_out = f" · {dropped} oldest message{'s' * (dropped != 1)} left out to fit the context" if dropped else ""
            view.set_meta(meta_line(metrics.num_tokens, metrics.tokens_per_s, metrics.ttft_s, end.finish_reason,
                                    message.model) + hit + left_out)
        else:
            view.remove()
        if end.tool_calls and message is not None:
            view.markdown.update(shown(message))  # the calls, one line each, as a stored reply shows them
            self._pane.message_list.release_reply_space()
        else:
            self._pane.live = None
        self._pane.refresh_meter(recount=True)

    # a round of tool calls (the session's `ToolRunner` asks; the view shows)

    async def ask(self, card: CallCard) -> Decision:
        """Show the approval card under the reply and wait for the user's answer; the input gets
        the focus back after."""
        pane = self._pane
        widget = ApprovalCard(card)
        await pane.message_list.mount(widget)
        pane.message_list.scroll_end(animate=False)
        widget.focus()
        try:
            return await widget.answer
        finally:
            await widget.remove()
            pane.focus_input()

    def tool_result(self, message: MessageRecord) -> None:
        self._pane.message_list.mount(MessageView("tool", shown(message)))

    def note(self, text: str) -> None:
        """The loop ended early: said under the last reply, and in a notice."""
        self._pane.live = None
        self._pane.message_list.mount(MessageView("note", text))
        self._pane.app.notify(text, title="Tools", severity="warning", timeout=8)


def mcp_prompts(pane: ChatPane) -> list[PromptInfo]:
    """The prompts of the app's ready MCP servers (`/name` in the input)."""
    manager = getattr(pane.app, "tools", None) if pane.is_attached else None
    return manager.prompts() if manager is not None else []

