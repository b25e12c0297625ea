"""A chat's messages on screen: one `MessageView` per stored message, mounted a page at a time
(newest first), the reply being generated below them, and the lines under a reply."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from rich.text import Text

from app.ui.attach import display_text
from app.ui.format import fmt_rate, fmt_seconds, fmt_wait
from app.ui.store import INTERRUPTED, MessageRecord
from app.ui.widgets import ChatScroll, EarlierMessages, MessageView

HISTORY_PAGE = 12  # messages mounted when a tab is first shown, and per "earlier messages" click
HIT_MARK_S = 2.0  # how long a search hit stays marked: long enough for the eye to find it


def meta_line(num_tokens: int, tokens_per_s: float | None, ttft_s: float | None, finish_reason: str | None,
              model: str | None = None) -> str:
    """The dim line under a reply: the model that wrote it (models can be switched mid-chat), its
    length, speed, time to first token and how it ended."""
    parts = [f"{num_tokens} tok", f"{fmt_rate(tokens_per_s)} tok/s", f"TTFT {fmt_seconds(ttft_s)}"]
    if model:
        parts.insert(0, model)
    note = {"abort": "stopped", "length": "hit max tokens", INTERRUPTED: "cut off: the app stopped"}.get(finish_reason or "")
    return " · ".join(parts + ([note] if note else []))


def reading_line(status: str, computed: int, prompt: int, prefill_tok_s: float) -> str:
    """The line under a reply while its prompt is read (a pasted file can take a minute): how far,
    and the time left at the engine's recent prefill rate."""
    if status == "waiting":
        return f"waiting for the engine · {prompt:,} prompt tokens"
    left = max(prompt - computed, 0)
    eta = f" · ~{fmt_wait(left / prefill_tok_s)} left" if prefill_tok_s > 0 and left else ""
    return f"reading {min(computed, prompt):,} / {prompt:,} tokens{eta}"


def reply_meta(message: MessageRecord) -> str:
    if message.role != "assistant" or not message.num_tokens:
        return ""
    return meta_line(message.num_tokens, message.tokens_per_s, message.ttft_s, message.finish_reason, message.model)


def shown(message: MessageRecord) -> str:
    """A message as its view shows it: a user's attached files as one line each, an assistant's
    tool calls as one line each under its text."""
    if message.role == "user":
        return display_text(message.content)
    calls = [call.get("function") or {} for call in message.tool_calls or []]
    lines = [f"→ {f.get('name', '?')}({f.get('arguments', '')})" for f in calls]
    return "\n".join(([message.content] if message.content else []) + lines)


class MessageList(ChatScroll):
    """The views of `messages()` (the session's), the oldest mounted ones from `first_mounted` on."""

    def __init__(self, messages: Callable[[], list[MessageRecord]], **kwargs: object) -> None:
        super().__init__(**kwargs)
        self._messages = messages
        self.first_mounted: int | None = None  # index of the oldest mounted message; None: none yet
        self._held_view: MessageView | None = None  # the last reply, holding its streaming height

    def ensure_shown(self) -> None:
        """Mount the newest page, once (a tab's history is mounted when it is first shown)."""
        if self.first_mounted is None:
            self.first_mounted = len(self._messages())
            self.show_older(HISTORY_PAGE)

    def show_older(self, count: int) -> None:
        """Mount up to `count` more of the oldest unmounted messages above the mounted ones: a
        Markdown view per message costs a parse and a layout, too much for hundreds at once."""
        end = self.first_mounted
        self.first_mounted = start = max(end - count, 0)
        views = [MessageView(m.role, shown(m), reply_meta(m)) for m in self._messages()[start:end]]
        for old in self.query(EarlierMessages):
            old.remove()
        if start:
            views.insert(0, EarlierMessages(start))
        if views:
            self.mount_all(views, before=0 if self.children else None)

    def on_earlier_messages_pressed(self, event: EarlierMessages.Pressed) -> None:
        event.stop()
        self.show_older(HISTORY_PAGE)

    def reveal(self, index: int) -> None:
        """Show message `index` (a search hit): mount the pages of history down to it, scroll it
        to the top of the view and mark it for a moment so the eye finds it."""
        if not 0 <= index < len(self._messages()):
            return
        self.ensure_shown()
        if index < self.first_mounted:
            pages = -(-(self.first_mounted - index) // HISTORY_PAGE)
            self.show_older(pages * HISTORY_PAGE)
        view = list(self.query_children(MessageView))[index - self.first_mounted]
        view.add_class("hit")
        self.set_timer(HIT_MARK_S, lambda: view.remove_class("hit"))
        self._scroll_to_top(view)

    def _scroll_to_top(self, view: MessageView, tries: int = 10) -> None:
        """Scroll `view` to the top once it is laid out (a page just mounted is not, yet)."""
        if not view.virtual_region.size and tries:
            self.call_after_refresh(self._scroll_to_top, view, tries - 1)
            return
        self.scroll_to_widget(view, animate=False, top=True)

    def remove_last(self, count: int) -> list[MessageView]:
        """Take away the views of the last `count` stored messages (and an earlier attempt's
        error view: it was never stored); returns the stored messages' views left."""
        self.release_reply_space()
        self.drop_failed_views()
        views = [view for view in self.query(MessageView) if not view.has_class("failed")]
        kept, gone = views[:len(views) - count], views[len(views) - count:] if count else []
        for view in gone:
            view.remove()
        self.first_mounted = min(self.first_mounted or 0, len(self._messages()))
        return kept

    def mount_turn(self, user_text: str) -> tuple[MessageView, Awaitable[None]]:
        """A user's message and the view of the reply to it, mounted together (one layout)."""
        reply = self._reply_view(self._user_height(user_text))
        return reply, self.mount_all([MessageView("user", user_text), reply])

    def mount_reply(self, above: list[MessageView]) -> tuple[MessageView, Awaitable[None]]:
        """The view of a reply below the views `above` (a regenerated reply, the next of a turn)."""
        reply = self._reply_view(_height_with_margin(above[-1]) if above else None)
        return reply, self.mount(reply)

    def _reply_view(self, above: int | None) -> MessageView:
        """A reply's view whose streaming body fills the view below the user's message, `above`
        lines high (None: not known), so the question stays at the top while the reply fills the
        screen below it, and a reply shorter than a screen never grows its body (a layout each time)."""
        room = self.scrollable_content_region.height - above - 2 if above is not None else 0  # role line, margin
        return MessageView("assistant", streaming=True, stream_height=room)

    def _user_height(self, text: str) -> int:
        """A user message's height once mounted (role line, wrapped text, margin), before it is."""
        width = self.scrollable_content_region.width - 2  # the body's padding
        return 2 + len(Text(text).wrap(self.app.console, width)) if width > 0 else 0

    def hold_reply_space(self, view: MessageView) -> None:
        """A finished reply keeps its streaming height until the next message: a short reply in a
        screen-high body would otherwise shrink and scroll the chat under the reader's eyes."""
        view.styles.min_height = view.size.height
        self._held_view = view

    def release_reply_space(self) -> None:
        if self._held_view is not None:
            self._held_view.styles.min_height = None
            self._held_view = None

    def drop_failed_views(self) -> None:
        """Remove an earlier attempt's error view: the new reply replaces it."""
        for failed in self.query(".message.failed"):
            failed.remove()


def _height_with_margin(view: MessageView) -> int:
    margin = view.styles.margin
    return view.outer_size.height + margin.top + margin.bottom
