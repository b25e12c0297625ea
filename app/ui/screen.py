"""The main screen: chat tabs on the left, model line, KV-budget and throughput panels on the right.

Panels are redrawn from one `engine.stats()` snapshot every `poll_interval` (rounded to frames)
while anything runs, once a second when idle."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from pathlib import Path

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import (
    ContentSwitcher,
    Header,
    Static,
    Tab,
    TabbedContent,
    TabPane,
    Tabs,
)

from app.engine.api.engine_client import EngineClient
from app.engine.types.errors import LocalbatchError
from app.engine.types.outputs import EngineStats, RequestStats
from app.ui import cropped_compositor
from app.ui.attach import Attachment
from app.ui.attach_dialog import AttachDialog
from app.ui.chat import ChatPane, reading_line
from app.ui.chat_list import ChatListScreen
from app.ui.clipboard import Copyable, code_blocks, copy_text
from app.ui.dialogs import ConfirmDialog, CopyPicker, MessagePicker, ModelPicker, RenameDialog
from app.ui.endpoint import EmbeddedEndpoint
from app.ui.export import export_chat
from app.ui.keys import chat_bindings
from app.ui.loading import EngineInfo, first_line
from app.ui.panels import (
    KVBudgetPanel,
    Owner,
    PanelText,
    TabRate,
    ThroughputHistory,
    ThroughputPanel,
)
from app.ui.reply_stream import FRAME_HZ
from app.ui.store import ChatRecord, ChatStore, StoreError
from app.ui.textual_private import QUIET_RELABEL, supported
from app.ui.widgets import StableFooter

TAB_COLORS = ("dodger_blue1", "green3", "orange1", "medium_purple1", "deep_pink2", "cyan3", "gold1", "salmon1")
ACTIVE_CHAT_KEY = "active_chat"


class ChatTabs(TabbedContent):
    """TabbedContent that activates a tab on focus only while the focus is still inside it:
    switching tabs faster than focus events arrive would otherwise bounce back to a tab left."""

    def _on_tab_pane_focused(self, event: TabPane.Focused) -> None:
        focused = self.screen.focused
        if focused is None or event.tab_pane not in focused.ancestors_with_self:
            event.stop()
            event.prevent_default()  # skips TabbedContent's handler


class ChatScreen(Screen):
    BINDINGS = chat_bindings()

    def __init__(
        self,
        engine: EngineClient,
        store: ChatStore,
        info: EngineInfo,
        endpoint: EmbeddedEndpoint | None,
        export_dir: Callable[[], Path],
        poll_interval: float = 1.0,
    ) -> None:
        super().__init__()
        cropped_compositor.install(self)  # a frame renders only what it repaints
        self.engine = engine
        self.store = store
        self.info = info
        self.endpoint = endpoint
        self._export_dir = export_dir
        self._poll_interval = poll_interval
        self.history = ThroughputHistory()
        self._endpoint_note = ""
        self._engine_busy = False  # the last stats snapshot had requests running or waiting
        self._prefill_rate = 0.0  # tokens/s, the engine's latest nonzero prefill rate

    # layout

    def compose(self) -> ComposeResult:
        chats = self.store.open_chats() or [self.store.create_chat("Chat 1", self.app.config.system_prompt)]
        active = self.store.get_meta(ACTIVE_CHAT_KEY)
        initial = f"chat-{active}" if active and any(str(c.id) == active for c in chats) else f"chat-{chats[0].id}"
        yield Header(show_clock=False, icon="◆")
        with Horizontal(id="body"):
            with ChatTabs(initial=initial, id="chats"):
                for chat in chats:
                    yield self._pane(chat)
            with Vertical(id="sidebar"):
                yield Static(self._model_text(), id="model-info")
                yield KVBudgetPanel(id="kv-panel")
                yield ThroughputPanel(id="tp-panel")
                yield PanelText(id="endpoint-status")
                yield Static("", id="pull-status")
        yield StableFooter()

    def _pane(self, chat: ChatRecord) -> ChatPane:
        color = TAB_COLORS[(chat.id - 1) % len(TAB_COLORS)]
        settings_key = self.app.keys["settings"].split(",")[0]
        return ChatPane(chat, self.store.messages(chat.id), self.engine, self.store, color, settings_key)

    def _model_text(self) -> Text:
        text = Text(self.info.headline(), style="bold")
        for line in self.info.details():
            text.append("\n" + line, style="dim")
        return text

    def on_mount(self) -> None:
        self.title = "localbatch"
        self.sub_title = self.info.headline()
        for pane in self.panes():
            self.query_one(TabbedContent).get_tab(pane.id).label = pane.tab_label()
        self.poll_stats()
        # One clock for everything that repaints while replies stream, so the reply and the
        # panels land in the same frame instead of costing a screen refresh each.
        self._frames_per_poll = max(round(self._poll_interval * FRAME_HZ), 1) if self._poll_interval > 0 else 0
        self._frame = 0
        self.set_interval(1 / FRAME_HZ, self._on_frame)
        self.call_after_refresh(self._focus_active)
        self.call_after_refresh(freeze_long_lived_objects)
        self._pull_text: str | None = None
        self.set_interval(0.25, self._paint_pull)

    def take_input(self, draft: str, queued: str | None) -> None:
        """What was typed while the model loaded: the message sent then goes to the shown tab, a
        draft into its input."""
        pane = self.active_pane()
        if pane is None:
            return
        if queued:
            pane.send(queued)
        if draft:
            pane.load_input(draft)

    def on_unmount(self) -> None:
        gc.unfreeze()  # this screen's objects may be garbage now (a model switch, the app's exit)

    async def _on_frame(self) -> None:
        self._frame += 1
        pane = self.active_pane()
        if pane is not None:
            await pane.paint_reply()
        if self._frames_per_poll and self._frame % self._poll_every() == 0:
            self.poll_stats()

    def _poll_every(self) -> int:
        """Frames between panel refreshes: the configured period while anything runs; idle, only
        the recent rates decay (and an API request may arrive), so once a second is enough."""
        if self._engine_busy or any(p.generating for p in self.panes()):
            return self._frames_per_poll
        return max(self._frames_per_poll, FRAME_HZ)

    def _focus_active(self) -> None:
        pane = self.active_pane()
        if pane is not None:
            pane.focus_input()

    # tabs

    def panes(self) -> list[ChatPane]:
        # The switcher's children, not a DOM query: that would walk every message block of every
        # tab, several times a second (the stats poll asks for the panes).
        switcher = self.query_one(TabbedContent).query_one(ContentSwitcher)
        return [pane for pane in switcher.children if isinstance(pane, ChatPane)]

    def active_pane(self) -> ChatPane | None:
        pane = self.query_one(TabbedContent).active_pane
        return pane if isinstance(pane, ChatPane) else None

    def on_chat_pane_changed(self, event: ChatPane.Changed) -> None:
        pane = event.pane
        if pane.is_attached:
            relabel(self.query_one(TabbedContent).get_tab(pane.id), pane.tab_label())

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        pane = self.active_pane()
        if pane is not None:
            self.store.set_meta(ACTIVE_CHAT_KEY, str(pane.chat.id))
            pane.focus_input()

    async def action_new_tab(self) -> None:
        number = len(self.panes()) + 1
        await self._open(self.store.create_chat(f"Chat {number}", self.app.config.system_prompt))

    async def action_fork(self, upto: int | None = None) -> None:
        """A new tab with this chat's history (up to message index `upto`, else all of it). Its
        next prompt starts with the same tokens, so the prefix cache serves them: no recompute
        while this chat's blocks are held or still cached."""
        pane = self.active_pane()
        if pane is None:
            return
        messages = pane.messages if upto is None else pane.messages[: upto + 1]
        fork = self.store.fork_chat(pane.chat, messages, _fork_title(pane.chat.title))
        await self._open(fork)
        self.notify(f"Forked “{pane.chat.title}” at message {len(messages)} of {len(pane.messages)}")

    def action_fork_at(self) -> None:
        pane = self.active_pane()
        if pane is None or not pane.messages:
            self.notify("Nothing to fork at yet", severity="warning")
            return

        def chosen(index: int | None) -> None:
            if index is not None:
                self.run_worker(self.action_fork(index), group="tabs")

        self.app.push_screen(MessagePicker(pane.messages), chosen)

    async def _open(self, chat: ChatRecord) -> ChatPane:
        pane = self._pane(chat)
        tabs = self.query_one(TabbedContent)
        await tabs.add_pane(pane)
        tabs.get_tab(pane.id).label = pane.tab_label()
        tabs.active = pane.id
        pane.focus_input()
        return pane

    def action_next_tab(self) -> None:
        self._cycle(1)

    def action_previous_tab(self) -> None:
        self._cycle(-1)

    def _cycle(self, step: int) -> None:
        panes, active = self.panes(), self.active_pane()
        if len(panes) > 1 and active is not None:
            self.query_one(TabbedContent).active = panes[(panes.index(active) + step) % len(panes)].id

    def action_close_tab(self) -> None:
        """Close the tab and keep its chat (the chat list reopens it): nothing is lost, so no
        question. An empty chat is deleted: there is nothing to list."""
        pane = self.active_pane()
        if pane is None:
            return
        if not pane.messages and not pane.generating:
            self.run_worker(self._delete(pane), group="tabs")
        elif self.store.write_error is not None:
            self.action_delete_chat()  # chats held only in memory: a closed one could not be listed
        else:
            self.run_worker(self._close(pane), group="tabs")

    async def _close(self, pane: ChatPane) -> None:
        await pane.stop_and_wait()  # its partial reply is committed: the closed chat keeps it
        self.store.set_open(pane.chat.id, False)
        await self._remove_tab(pane)
        key = self.app.keys["chat_list"].split(",")[0]
        self.notify(f"Closed “{pane.chat.title}”: {key} lists it")

    def action_delete_chat(self) -> None:
        pane = self.active_pane()
        if pane is None:
            return
        if not pane.messages and not pane.generating:
            self.run_worker(self._delete(pane), group="tabs")
            return
        question = f"Delete “{pane.chat.title}” and its {len(pane.messages)} messages?"

        def answered(confirmed: bool | None) -> None:
            if confirmed:
                self.run_worker(self._delete(pane), group="tabs")

        self.app.push_screen(ConfirmDialog(question), answered)

    async def _delete(self, pane: ChatPane) -> None:
        await pane.stop_and_wait()
        self.store.delete_chat(pane.chat.id)
        await self._remove_tab(pane)

    async def _remove_tab(self, pane: ChatPane) -> None:
        """Take the tab away; the last one gives way to a new empty chat."""
        await self.query_one(TabbedContent).remove_pane(pane.id)
        if not self.panes():
            await self.action_new_tab()
        else:
            self._focus_active()

    # the chat list

    def action_chat_list(self, query: str = "", search: bool = False) -> None:
        """Every chat, open or closed, and a search over all their messages: the chosen one opens
        in a tab (or its tab is shown), at the chosen message."""

        def chosen(target: tuple[int, int | None] | None) -> None:
            if target is not None:
                self.run_worker(self.show_chat(*target), group="tabs")

        self.app.push_screen(ChatListScreen(self.store, self.delete_chat_by_id, query, search), chosen)

    async def show_chat(self, chat_id: int, message_index: int | None = None) -> None:
        """Show chat `chat_id` in its tab, opening one for it if it is closed; then message
        `message_index` (a search hit), if given."""
        pane = self._pane_of(chat_id)
        if pane is None:
            self.store.set_open(chat_id, True)
            try:
                chat = self.store.chat(chat_id)
            except StoreError as e:
                self.notify(f"{e}: it was deleted", severity="warning")
                return
            await self._open(chat)
            pane = self._pane_of(chat_id)
        else:
            self.query_one(TabbedContent).active = pane.id
            pane.focus_input()
        if pane is not None and message_index is not None:
            pane.reveal_message(message_index)

    async def delete_chat_by_id(self, chat_id: int) -> None:
        """Delete a chat chosen in the chat list: its tab too, if it is open (its reply stopped first)."""
        pane = self._pane_of(chat_id)
        if pane is not None:
            await self._delete(pane)
        else:
            self.store.delete_chat(chat_id)

    def _pane_of(self, chat_id: int) -> ChatPane | None:
        return next((pane for pane in self.panes() if pane.chat.id == chat_id), None)

    # generation

    def action_stop(self) -> None:
        pane = self.active_pane()
        if pane is not None:
            pane.stop()

    def action_stop_all(self) -> None:
        stopped = sum(pane.stop() for pane in self.panes())
        self.notify(f"Stopped {stopped} tab{'s' * (stopped != 1)}" if stopped else "Nothing is generating")

    def action_regenerate(self) -> None:
        pane = self.active_pane()
        if pane is not None and not pane.regenerate():
            self.notify("Nothing to regenerate" if not pane.messages else "Still generating: stop it first (escape)")

    def action_send(self) -> None:
        pane = self.active_pane()
        if pane is not None:
            pane.send_input()

    def action_broadcast(self) -> None:
        active = self.active_pane()
        text = active.input_text().strip() if active else ""
        if not text:
            self.notify("Type a prompt first, then broadcast it to every tab", severity="warning")
            return
        panes = self.panes()
        sent = sum(p.send(text) for p in panes)
        active.clear_input()
        busy = len(panes) - sent
        if len(panes) > 1 or busy:  # to a lone tab it is a plain send: its reply says so (a toast lays out the screen)
            self.notify(f"Broadcast to {sent} tab{'s' * (sent != 1)}" + (f"; {busy} busy, skipped" if busy else ""))

    # composing: files, taking a turn back, editing an earlier message in a fork

    def action_attach(self) -> None:
        pane = self.active_pane()
        if pane is None:
            return

        def chosen(files: list[Attachment] | None) -> None:
            if files is not None:
                pane.set_attachments(files)
            pane.focus_input()

        self.app.push_screen(AttachDialog(pane.attachments), chosen)

    def action_edit_last(self) -> None:
        pane = self.active_pane()
        if pane is None:
            return
        if pane.generating:
            self.notify("Still generating: stop it first (escape)", severity="warning")
        elif not pane.take_back_last_turn():
            self.notify("No message of yours to edit yet", severity="warning")

    def action_edit_at(self) -> None:
        """Pick one of your messages: a fork of the chat up to just before it opens with the
        message in its input (this chat stays as it was); the fork's prompt reuses its KV blocks."""
        pane = self.active_pane()
        users = [i for i, m in enumerate(pane.messages) if m.role == "user"] if pane else []
        if pane is None or not users:
            self.notify("No message of yours to edit yet", severity="warning")
            return

        def chosen(index: int | None) -> None:
            if index is not None:
                self.run_worker(self._edit_in_fork(pane, index), group="tabs")

        self.app.push_screen(MessagePicker(pane.messages, roles=("user",), question="Edit which message (in a fork)?"),
                             chosen)

    async def _edit_in_fork(self, pane: ChatPane, index: int) -> None:
        message = pane.messages[index]
        fork = self.store.fork_chat(pane.chat, pane.messages[:index], _fork_title(pane.chat.title))
        new = await self._open(fork)
        new.load_message(message.content)
        self.notify(f"Edit message {index + 1} here and press enter; “{pane.chat.title}” keeps the original")

    # chat management

    def action_rename(self) -> None:
        pane = self.active_pane()
        if pane is None:
            return

        def renamed(title: str | None) -> None:
            if title:
                pane.rename(title)

        self.app.push_screen(RenameDialog(pane.chat.title), renamed)

    def action_settings(self) -> None:
        pane = self.active_pane()
        if pane is not None:
            pane.toggle_settings()

    def action_toggle_json(self) -> None:
        pane = self.active_pane()
        if pane is not None:
            state = "on: replies are JSON" if pane.toggle_json_mode() else "off"
            self.notify(f"JSON mode {state} in {pane.chat.title}")

    def action_export(self) -> None:
        pane = self.active_pane()
        if pane is None:
            return
        try:
            path = export_chat(pane.chat, pane.messages, self._export_dir(), self.info.model_name)
        except LocalbatchError as e:
            self.notify(str(e), severity="error")
            return
        self.notify(f"Exported to {path}", title="Export")

    def action_copy_reply(self) -> None:
        """The last finished reply (a streaming one is not whole yet), as its Markdown."""
        pane = self.active_pane()
        replies = [m for m in pane.messages if m.role == "assistant"] if pane else []
        if not replies:
            self.notify("No reply to copy yet", severity="warning")
            return
        self._copy(Copyable(replies[-1].content, what="the last reply"))

    def action_copy_code(self) -> None:
        """The last code block of the newest reply that has one."""
        pane = self.active_pane()
        replies = [m for m in pane.messages if m.role == "assistant"] if pane else []
        block = next((b[-1] for b in (code_blocks(m.content) for m in reversed(replies)) if b), None)
        if block is None:
            self.notify("No code block in this chat yet", severity="warning")
            return
        self._copy(Copyable(block.code, block.language))

    def action_copy_pick(self) -> None:
        pane = self.active_pane()
        if pane is None or not pane.messages:
            self.notify("Nothing to copy yet", severity="warning")
            return

        def chosen(item: Copyable | None) -> None:
            if item is not None:
                self._copy(item)

        self.app.push_screen(CopyPicker(pane.messages), chosen)

    def _copy(self, item: Copyable) -> None:
        self.notify(item.notice(copy_text(self.app, item.text)), title="Copy")

    # models

    def action_switch_model(self) -> None:
        if self.engine.is_remote:
            self.notify("The remote server chooses the model; run without --backend-url to switch models here.",
                        severity="warning")
            return
        from app.engine.gguf.catalog import CATALOG, picker_entries

        entries = picker_entries()
        ready = {name: ok for name, _, ok in entries}
        state = getattr(self.app, "pulling", None)
        pulling = state.name if state is not None and not state.done else None

        def chosen(target: str | None) -> None:
            if target and target in ready and not ready[target]:
                self.app.pull_model(target)
            elif target and target != self.info.model_name:
                # The app's worker, not this screen's: the switch replaces this screen.
                self.app.run_worker(self.app.switch_model(target), group="switch-model", exclusive=True)

        sizes = {e.name: f"{e.size / 1e9:.1f} GB" if e.size >= 1e9 else f"{e.size / 1e6:.0f} MB" for e in CATALOG.values()}
        self.app.push_screen(ModelPicker(entries, self.info.model_name, sizes, pulling), chosen)

    def _paint_pull(self) -> None:
        """The side panel's pull line, from the pull thread's latest report (frame clock)."""
        state = getattr(self.app, "pulling", None)
        text = state.line() if state is not None and not state.done else ""
        widget = self.query_one("#pull-status", Static)
        if text != self._pull_text:
            self._pull_text = text
            widget.update(text)
            widget.display = bool(text)

    # embedded endpoint

    def action_toggle_endpoint(self) -> None:
        self.run_worker(self.toggle_endpoint(), group="endpoint", exclusive=True)

    async def toggle_endpoint(self, start: bool | None = None) -> None:
        endpoint = self.endpoint
        if endpoint is None:
            self.notify("This backend has no embedded endpoint", severity="warning")
            return
        if start is None:
            start = not endpoint.running
        if not start:
            await endpoint.stop()
            self.notify("Endpoint stopped")
            return
        self._endpoint_note = f"starting on {endpoint.address} …"
        try:
            address = await endpoint.start()
        except LocalbatchError as e:
            self._endpoint_note = f"failed: {e}"
            self.notify(str(e), title="Endpoint", severity="error")
            return
        self._endpoint_note = ""
        self.notify(f"Serving the OpenAI API on {address}", title="Endpoint")

    def _endpoint_text(self) -> Text:
        endpoint = self.endpoint
        if endpoint is None:
            return Text("remote backend", style="dim")
        if endpoint.running and not self._endpoint_note:
            return Text.assemble(("API ", "bold"), (endpoint.address, "bold green"))
        if self._endpoint_note or endpoint.error:
            return Text.assemble(("API ", "bold"), (self._endpoint_note or f"stopped: {endpoint.error}", "yellow"))
        key = self.app.keys["toggle_endpoint"].split(",")[0]
        return Text.assemble(("API ", "bold"), (f"off · {key} serves on port {endpoint.port}", "dim"))

    # panels

    def poll_stats(self, now: float | None = None) -> None:
        """Redraw the panels from one stats snapshot (the timer's callback; tests call it directly)."""
        try:
            stats = self.engine.stats()
        except LocalbatchError as e:
            self.query_one("#endpoint-status", PanelText).show(Text(f"engine: {first_line(e)}", style="bold red"))
            return
        self._engine_busy = bool(stats.num_running or stats.num_waiting)
        panes = self.panes()
        self._prefill_rate = _read_rate(stats, self._prefill_rate)
        for pane in panes:
            pane.prefill_rate = self._prefill_rate
            pane.kv_pool_tokens = stats.num_blocks_total * stats.block_size
        tab_owners = [Owner(p.id, p.chat.title, p.color) for p in panes]
        owners = {p.request_id: owner for p, owner in zip(panes, tab_owners) if p.request_id}
        # A remote server's figures say nothing of what an idle tab holds: no row for it there.
        tabs = [] if self.engine.is_remote else tab_owners
        self.query_one(KVBudgetPanel).show(stats, owners, self.engine.stats_source, tabs)
        self.history.observe(time.monotonic() if now is None else now, stats.decode_tokens_per_s)
        self.query_one(ThroughputPanel).show(stats, self._rate_rows(stats, panes, owners), self.history)
        self.query_one("#endpoint-status", PanelText).show(self._endpoint_text())

    def _rate_rows(self, stats: EngineStats, panes: list[ChatPane], owners: dict[str, Owner]) -> list[TabRate]:
        by_id = {r.request_id: r for r in stats.requests}
        rows = [_pane_rate(p, by_id.get(p.request_id or ""), stats.prefill_tokens_per_s) for p in panes]
        api = [r for r in stats.requests if r.request_id not in owners]
        if api:
            rates = [r.tokens_per_s for r in api if r.tokens_per_s is not None]
            ttfts = [r.ttft_s for r in api if r.ttft_s is not None]
            rows.append(
                TabRate(
                    f"API ({len(api)} req)", "grey70", sum(rates) if rates else None,
                    sum(ttfts) / len(ttfts) if ttfts else None, "decode",
                )
            )
        return rows

    async def stop_all_and_wait(self) -> None:
        for pane in self.panes():
            await pane.stop_and_wait()


def _pane_rate(pane: ChatPane, req: RequestStats | None, prefill_rate: float = 0.0) -> TabRate:
    metrics = pane.metrics
    if req is not None and req.status in ("waiting", "prefill"):
        pane.show_reading(reading_line(req.status, req.num_computed_tokens, req.num_prompt_tokens, prefill_rate))
    tps = metrics.tokens_per_s if metrics else None
    ttft = metrics.ttft_s if metrics else None
    if req is not None:
        tps = req.tokens_per_s if req.tokens_per_s is not None else tps
        ttft = req.ttft_s if req.ttft_s is not None else ttft
        pane.engine_figures = (tps, ttft)
        if req.num_cached_tokens:
            pane.cache_hit = (req.num_cached_tokens, req.num_prompt_tokens)
        status = req.status
    elif pane.engine_figures is not None:
        tps, ttft = pane.engine_figures
        status = "decode" if pane.generating else "idle"
    elif pane.generating:
        status = "decode" if ttft is not None else "waiting"
    else:
        status = "idle"
    return TabRate(pane.chat.title, pane.color, tps, ttft, status)


def _read_rate(stats: EngineStats, last: float) -> float:
    """Tokens a second a prompt is read at, for the input's cost estimate: the prompts read lately
    (their uncached tokens over their time to first token, queueing included: the wait a person
    sees); the engine's recent prefill rate (which counts decode-only steps too) until there is
    one; idle, the last one."""
    read = [(r.num_prompt_tokens - r.num_cached_tokens) / r.ttft_s for r in stats.requests
            if r.ttft_s and r.num_prompt_tokens - r.num_cached_tokens >= 64]
    if read:
        return max(read)
    return last or stats.prefill_tokens_per_s


def relabel(tab: Tab, label: Text) -> None:
    """Set a tab's label without animating the tabs' underline: Textual slides it for 0.3 s (a
    repaint of the screen every frame) at every relabel, which came at every reply's start and end
    (the busy dot) and at a chat's first message (its title). A label of the same width leaves it
    alone; one of another width puts it under the tab at once."""
    moved = tab.label.cell_length != label.cell_len
    if moved and not supported(QUIET_RELABEL):
        tab.label = label  # Textual's private API changed: its own relabel, which slides the underline
        return
    with tab.prevent(Tab.Relabelled):
        tab.label = label
    tabs = next((node for node in tab.ancestors if isinstance(node, Tabs)), None) if moved else None
    if tabs is not None:
        tabs._highlight_active(animate=False)  # private; textual_private checks it (QUIET_RELABEL)


def _fork_title(title: str) -> str:
    base = title.removesuffix(" (fork)")
    return f"{base} (fork)"


def freeze_long_lived_objects() -> None:
    """Move every object alive now (the widgets, styles and caches of a freshly built screen) out
    of the collector's reach. Streaming churns enough garbage for a full collection every few
    seconds, and each walked all of them holding the GIL (the engine's step thread stalls) and
    slowed tab switches (docs/tuning.md). Objects made later are collected as usual."""
    gc.collect()
    gc.freeze()
