"""The chat list: every stored chat, open as a tab or closed, and a full-text search over all of
their messages. Choosing a row dismisses with (chat id, message index or None); the chat screen
opens that chat and shows the message."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from rich.text import Text
from textual import events, on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.timer import Timer
from textual.widgets import Input, Label, OptionList
from textual.widgets.option_list import Option

from app.ui.dialogs import ConfirmDialog
from app.ui.store import HIT_CLOSE, HIT_OPEN, ChatStore, ChatSummary, SearchHit

SEARCH_DELAY_S = 0.15  # typing pauses this long before the list is searched again
Target = tuple[int, "int | None"]  # (chat id, message index or None: the chat as it is)


class ChatListScreen(ModalScreen["Target | None"]):
    """Every chat, most recently active first; typing searches every message. Enter opens the
    row's chat (at the hit message), delete deletes a chat (asks first), escape closes."""

    BINDINGS = [
        Binding("escape", "cancel", "Cancel"),
        Binding("delete", "delete", "Delete chat"),
        Binding("down", "focus_list", "Results", show=False),
    ]

    def __init__(self, store: ChatStore, delete_chat: Callable[[int], Awaitable[None]], query: str = "",
                 search: bool = False) -> None:
        super().__init__(classes="dialog-screen")
        self._store = store
        self._delete_chat = delete_chat  # the chat screen's: stops its reply, closes its tab, deletes it
        self._query = query
        self._search = search or bool(query)  # start in the search box, else in the list
        self._targets: list[Target] = []  # per option, what choosing it opens
        self._summaries: dict[int, ChatSummary] = {}  # of the chat rows shown (none while searching)
        self._timer: Timer | None = None

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog chat-list"):
            yield Input(self._query, placeholder="Search every chat… (full text)", id="chat-search",
                        select_on_focus=False)  # typing in the list starts a query here: keep its first letter
            yield Label("", id="chat-count", classes="chat-count")
            yield OptionList(id="chat-results")
            yield Label("enter opens · delete deletes a chat · escape closes", classes="chat-hint")

    def on_mount(self) -> None:
        self._fill()
        (self.query_one(Input) if self._search else self.query_one(OptionList)).focus()

    # the list

    def _fill(self) -> None:
        """Rebuild the rows from the store: the chats for an empty query, else the search's hits."""
        self._timer = None
        query = self.query_one(Input).value.strip()
        if query:
            hits = self._store.search(query)
            self._summaries = {}
            self._targets = [(hit.chat_id, hit.message_index) for hit in hits]
            options = [Option(hit_row(hit), id=f"hit-{hit.message_id}") for hit in hits]
            chats = len({hit.chat_id for hit in hits})
            count = f"{_plural(len(hits), 'match', 'matches')} in {_plural(chats, 'chat')}"
        else:
            summaries = self._store.chat_summaries()
            self._summaries = {s.chat.id: s for s in summaries}
            self._targets = [(s.chat.id, None) for s in summaries]
            options = [Option(chat_row(s), id=f"chat-{s.chat.id}") for s in summaries]
            count = _plural(len(summaries), "chat")
        results = self.query_one(OptionList)
        results.clear_options()
        results.add_options(options)
        results.highlighted = 0 if options else None
        self.query_one("#chat-count", Label).update(count)

    @on(Input.Changed)
    def _changed(self) -> None:
        if self._timer is not None:
            self._timer.stop()
        self._timer = self.set_timer(SEARCH_DELAY_S, self._fill)

    @on(Input.Submitted)
    def _submitted(self) -> None:
        """Enter in the search box opens the highlighted row (the best hit)."""
        if self._timer is not None:
            self._timer.stop()
            self._fill()
        highlighted = self.query_one(OptionList).highlighted
        if highlighted is not None:
            self.dismiss(self._targets[highlighted])

    @on(OptionList.OptionSelected)
    def _selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self._targets[event.option_index])

    def on_key(self, event: events.Key) -> None:
        """Typing in the list goes to the search box."""
        search = self.query_one(Input)
        if self.focused is self.query_one(OptionList) and event.is_printable and event.character:
            event.stop()
            event.prevent_default()
            search.focus()
            search.insert_text_at_cursor(event.character)

    def action_focus_list(self) -> None:
        self.query_one(OptionList).focus()

    # actions

    def action_delete(self) -> None:
        results = self.query_one(OptionList)
        if self.focused is not results or results.highlighted is None:
            return
        summary = self._summaries.get(self._targets[results.highlighted][0])
        if summary is None:
            self.notify("Clear the search to delete a chat: the list then shows chats", severity="warning")
            return
        question = f"Delete “{summary.chat.title}” and its {_plural(summary.num_messages, 'message')}?"

        def answered(confirmed: bool | None) -> None:
            if confirmed:
                self.run_worker(self._delete(summary.chat.id), group="chat-list")

        self.app.push_screen(ConfirmDialog(question), answered)

    async def _delete(self, chat_id: int) -> None:
        await self._delete_chat(chat_id)
        self._fill()
        self.query_one(OptionList).focus()

    def action_cancel(self) -> None:
        self.dismiss(None)


def chat_row(summary: ChatSummary, now: float | None = None) -> Text:
    """A chat's row: a dot when it is open as a tab, its title; then its model, last activity and size."""
    chat = summary.chat
    row = Text.assemble(("● " if chat.open else "  ", "bold"), (chat.title, "bold"))
    details = [summary.model or "", when(summary.last_active, now), _plural(summary.num_messages, "message"),
               f"{summary.num_chars / 1000:.1f} KB"]
    row.append("\n    " + " · ".join(d for d in details if d), style="dim")
    return row


def hit_row(hit: SearchHit) -> Text:
    """A search hit's row: its chat and who wrote it; then the text around the match, highlighted."""
    row = Text.assemble((hit.chat_title, "bold"), (f" · {'You' if hit.role == 'user' else 'Assistant'}", "dim"))
    row.append("\n    ")
    snippet = " ".join(hit.snippet.split())
    for part in snippet.split(HIT_OPEN):
        matched, _, rest = part.rpartition(HIT_CLOSE)
        row.append(matched, style="bold reverse")
        row.append(rest)
    return row


def when(timestamp: float, now: float | None = None) -> str:
    """'today 14:05', or '2026-11-27 14:05' (local time)."""
    day = time.strftime("%Y-%m-%d", time.localtime(timestamp))
    today = time.strftime("%Y-%m-%d", time.localtime(time.time() if now is None else now))
    return time.strftime("today %H:%M" if day == today else "%Y-%m-%d %H:%M", time.localtime(timestamp))


def _plural(count: int, word: str, plural: str | None = None) -> str:
    return f"{count} {word if count == 1 else plural or word + 's'}"
