"""The main screen: chat tabs on the left, the sidebar (model line, KV-budget and throughput panels)
on the right. Its keys and palette entries are `commands.COMMANDS`.

Panels are redrawn from one `engine.stats()` snapshot every `poll_interval` (rounded to frames)
while anything runs, once a second when idle."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.screen import Screen
from textual.widgets import (
    ContentSwitcher,
    Header,
    Tab,
    TabbedContent,
    TabPane,
    Tabs,
)

from app.engine.api import process_settings
from app.engine.api.engine_client import EngineClient
from app.ui import chat_commands, cropped_compositor
from app.ui.chat import ChatPane
from app.ui.commands import command_bindings
from app.ui.endpoint import EmbeddedEndpoint
from app.ui.frame_clock import FrameClock
from app.ui.loading import EngineInfo
from app.ui.reply_stream import FRAME_HZ, FinalRenders
from app.ui.session.session import ChatSession
from app.ui.session.tools import ChatTools
from app.ui.sidebar import Sidebar
from app.ui.store import ChatRecord, ChatStore, StoreError
from app.ui.textual_private import QUIET_RELABEL, supported
from app.ui.widgets import StableFooter

TAB_COLORS = ("dodger_blue1", "green3", "orange1", "medium_purple1", "deep_pink2", "cyan3", "gold1", "salmon1")
ACTIVE_CHAT_KEY = "active_chat"


class ChatTabs(TabbedContent):
    """TabbedContent whose tab changes only when asked (a key, a click, a command). Textual's also
    follows focus into a tab, and a focus event that arrives after a switch then switches back."""

    def on_tab_pane_focused(self, event: TabPane.Focused) -> None:
        event.stop()
        event.prevent_default()  # skips TabbedContent's handler


class ChatScreen(Screen):
    BINDINGS = command_bindings()

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
        self.export_dir = export_dir
        self._poll_interval = poll_interval
        self._renders = FinalRenders()  # one for every tab: a reply's end knows whether others stream
        self.sidebar = Sidebar(engine, info, endpoint, lambda: self.app.keys["toggle_endpoint"].split(",")[0],
                               id="sidebar")

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
            yield self.sidebar
        yield StableFooter()

    def _pane(self, chat: ChatRecord) -> ChatPane:
        color = TAB_COLORS[(chat.id - 1) % len(TAB_COLORS)]
        settings_key = self.app.keys["settings"].split(",")[0]
        session = ChatSession(chat, self.store.messages(chat.id), self.engine, self.store)
        manager = self.app.tools
        if manager is not None:
            session.tool_runner = ChatTools(manager, manager.config.step_limit)
        return ChatPane(session, color, settings_key, self._renders)

    def on_mount(self) -> None:
        self.title = "localbatch"
        self.sub_title = self.info.headline()
        for pane in self.panes():
            self.query_one(TabbedContent).get_tab(pane.id).label = pane.tab_label()
        self.poll_stats()
        # One clock for everything that repaints while replies stream, so the reply and the
        # panels land in the same frame instead of costing a screen refresh each.
        clock = FrameClock(self.active_pane, self.poll_stats, self._busy, self._poll_interval)
        self.set_interval(1 / FRAME_HZ, clock.tick)
        self.call_after_refresh(self._focus_active)
        # The built screen's widgets leave the collector's reach: full collections while replies
        # stream walked them all holding the GIL (the process settings' one owner undoes it).
        self._process_settings = process_settings.hold()
        self.call_after_refresh(self._process_settings.freeze)

    def on_unmount(self) -> None:
        self._process_settings.release()

    def take_input(self, draft: str, queued: str | None) -> None:
        """What was typed while the model loaded: the message sent then goes to the shown tab, a
        draft into its input."""
        pane = self.active_pane()
        if pane is None:
            return
        if queued:
            pane.send(queued)
        if draft:
            pane.prompt.load_text(draft)

    def _busy(self) -> bool:
        return self.sidebar.engine_busy or any(p.generating for p in self.panes())

    def poll_stats(self, now: float | None = None) -> None:
        """Redraw the panels from one stats snapshot (the timer's callback; tests call it directly)."""
        self.sidebar.show_stats(self.panes(), now)

    def _focus_active(self) -> None:
        pane = self.active_pane()
        if pane is not None:
            pane.focus_input()

    def action_command(self, command_id: str) -> Awaitable[None] | None:
        """Run a command of `commands.COMMANDS` (its key, or the palette); what one must wait for
        is returned, and Textual awaits it as it awaits an async action."""
        return getattr(chat_commands, command_id)(self)

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
            self.store.set_meta(ACTIVE_CHAT_KEY, str(pane.session.chat.id))
            pane.focus_input()

    async def new_tab(self) -> None:
        number = len(self.panes()) + 1
        await self.open(self.store.create_chat(f"Chat {number}", self.app.config.system_prompt))

    async def open(self, chat: ChatRecord) -> ChatPane:
        pane = self._pane(chat)
        tabs = self.query_one(TabbedContent)
        await tabs.add_pane(pane)
        tabs.get_tab(pane.id).label = pane.tab_label()
        tabs.active = pane.id
        pane.focus_input()
        return pane

    def cycle(self, step: int) -> None:
        panes, active = self.panes(), self.active_pane()
        if len(panes) > 1 and active is not None:
            self.query_one(TabbedContent).active = panes[(panes.index(active) + step) % len(panes)].id

    async def close(self, pane: ChatPane) -> None:
        """Close `pane`'s tab; its chat is kept (its partial reply committed)."""
        await pane.stop_and_wait()
        self.store.set_open(pane.session.chat.id, False)
        await self._remove_tab(pane)
        key = self.app.keys["chat_list"].split(",")[0]
        self.notify(f"Closed “{pane.session.chat.title}”: {key} lists it")

    async def delete(self, pane: ChatPane) -> None:
        await pane.stop_and_wait()
        self.store.delete_chat(pane.session.chat.id)
        await self._remove_tab(pane)

    async def _remove_tab(self, pane: ChatPane) -> None:
        """Take the tab away; the last one gives way to a new empty chat."""
        await self.query_one(TabbedContent).remove_pane(pane.id)
        if not self.panes():
            await self.new_tab()
        else:
            self._focus_active()

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
            pane = await self.open(chat)
        else:
            self.query_one(TabbedContent).active = pane.id
            pane.focus_input()
        if message_index is not None:
            pane.message_list.reveal(message_index)

    async def delete_chat_by_id(self, chat_id: int) -> None:
        """Delete a chat chosen in the chat list: its tab too, if it is open (its reply stopped first)."""
        pane = self._pane_of(chat_id)
        if pane is not None:
            await self.delete(pane)
        else:
            self.store.delete_chat(chat_id)

    def _pane_of(self, chat_id: int) -> ChatPane | None:
        return next((pane for pane in self.panes() if pane.session.chat.id == chat_id), None)

    async def stop_all_and_wait(self) -> None:
        for pane in self.panes():
            await pane.stop_and_wait()


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
