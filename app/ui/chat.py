"""One chat tab: its messages, prompt input, settings, and the task that streams a reply.

The reply is consumed by an asyncio task in the app's own loop (a Textual worker): the engine's
`stream()` yields one delta per engine step into a buffer, and the screen's frame clock paints
the shown tab's reply at most `FRAME_HZ` times a second (`reply_stream`), so neither a
cross-thread call nor a repaint happens per token."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Awaitable
from dataclasses import replace
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.message import Message
from textual.widgets import TabPane
from textual.worker import Worker, WorkerCancelled, WorkerFailed

from app.engine.api.engine_client import EngineClient, Prompt
from app.engine.types.context_window import (
    OVERFLOW_STOP,
    ContextOverflowError,
    drop_oldest_turns,
    overflow_message,
    turn_starts,
    without_turns,
)
from app.engine.types.errors import LocalbatchError
from app.engine.types.outputs import StreamDelta
from app.engine.types.sampling_params import SamplingParams
from app.engine.types.timing import ReplyClock
from app.ui.attach import (
    Attachment,
    compose_message,
    display_text,
    mentioned_files,
    options_hint,
    read_attachment,
    split_message,
)
from app.ui.format import fmt_rate, fmt_seconds, fmt_wait
from app.ui.loading import first_line
from app.ui.reply_stream import DELTA_MAX_DELAY_S, ReplyWriter
from app.ui.store import INTERRUPTED, STREAMING, ChatRecord, ChatStore, MessageRecord
from app.ui.widgets import (
    ChatScroll,
    AttachmentsLine,
    ContextMeter,
    EarlierMessages,
    MessageView,
    PromptInput,
    SettingsForm,
    SettingsTitle,
)

# A growing reply is written to the store this often: what a crash can lose of it.
COMMIT_EVERY_S = 1.0

_DEFAULT_TITLE = re.compile(r"^Chat \d+$")
HISTORY_PAGE = 12  # messages mounted when a tab is first shown, and per "earlier messages" click
HIT_MARK_S = 2.0  # how long a search hit stays marked: long enough for the eye to find it

# Completion mode (a base model: no chat template). The transcript is plain text the model
# continues: the system prompt (if any) as a first paragraph, then one "User: ..." / "Assistant:
# ..." block per message, ending with "Assistant:". The reply ends at EOS, at max tokens, or when
# the model starts the next user turn (BASE_MODEL_STOP, which is cut from the reply).
_SPEAKERS = {"user": "User", "assistant": "Assistant", "system": "System"}
BASE_MODEL_STOP = "\nUser:"


def completion_prompt(history: list[dict[str, Any]]) -> str:
    """`history` (chat messages) as a plain-text transcript for a base model to continue."""
    parts = []
    for m in history:
        content = str(m["content"]).strip()
        parts.append(content + "\n" if m["role"] == "system" else f"{_SPEAKERS.get(m['role'], m['role'])}: {content}")
    return "\n".join(parts + ["Assistant:"])


class ReplyMetrics(ReplyClock):
    """Client-side timing of one reply (what the panels show when the engine has no figure)."""

    def observe(self, delta: StreamDelta, now: float) -> None:
        if not delta.token_ids and not delta.text:
            return
        self.tick(now)
        self.num_tokens = delta.num_output_tokens or self.num_tokens + max(len(delta.token_ids), 1)

    @property
    def ttft_s(self) -> float | None:
        return self.timing().ttft_s

    @property
    def tokens_per_s(self) -> float | None:
        return self.timing().tokens_per_s

    def summary(self, finish_reason: str | None, model: str | None = None) -> str:
        return meta_line(self.num_tokens, self.tokens_per_s, self.ttft_s, finish_reason, model)


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

    def __init__(
        self, chat: ChatRecord, messages: list[MessageRecord], engine: EngineClient, store: ChatStore, color: str,
        settings_key: str = "f3",
    ) -> None:
        super().__init__(chat.title, id=f"chat-{chat.id}")
        self._settings_key = settings_key
        self.chat = chat
        self.color = color
        self._engine = engine
        self._store = store
        self._messages = list(messages)
        self._worker: Worker | None = None
        self._streaming = False  # inside the stream loop (where stop() may cancel)
        self._stop_requested = False
        self.request_id: str | None = None
        self.metrics: ReplyMetrics | None = None
        self._writer: ReplyWriter | None = None
        self._held_view: MessageView | None = None  # the last reply, holding its streaming height
        self._live_view: MessageView | None = None  # the reply being generated
        self._reading = ""  # the prompt's progress line shown under that reply, until its first token
        self._first_mounted: int | None = None  # index of the oldest mounted message; None: none yet
        # The engine's (tok/s, TTFT) for the current reply, last seen while it ran: the panel keeps
        # showing the engine's measure after the reply ends instead of switching to the client's.
        self.engine_figures: tuple[float | None, float | None] | None = None
        self.finish_reason: str | None = None  # of the last reply
        # (cached, prompt) tokens of the current reply's prompt, when the prefix cache served some
        # (a forked chat's first reply): shown under the reply.
        self.cache_hit: tuple[int, int] | None = None
        self._attachments: list[Attachment] = []  # files for the next message
        self._left_out = 0  # oldest turns the current request leaves out to fit the context
        self._max_tokens: int | None = None  # the current request's max tokens, when cut to fit
        # Set by the screen's stats poll: the engine's latest prefill rate and KV pool size.
        self.prefill_rate = 0.0
        self.kv_pool_tokens = 0
        self._context_tokens: int | None = None  # the chat's prompt so far; None: not counted yet
        self._meter_timer = None
        self._warned_full = False

    # state

    @property
    def generating(self) -> bool:
        return self.request_id is not None

    @property
    def messages(self) -> list[MessageRecord]:
        return list(self._messages)

    def tab_label(self) -> Text:
        """The title, then a dot in the tab's colour while it generates (a blank of the same width
        otherwise: a reply starting or ending then moves no tab, see `screen.relabel`)."""
        label = Text(self.chat.title)
        label.append(" ●" if self.generating else "  ", style=self.color)
        return label

    def history(self) -> list[dict[str, Any]]:
        prompt = [{"role": "system", "content": self.chat.system_prompt}] if self.chat.system_prompt.strip() else []
        return prompt + [{"role": m.role, "content": m.content} for m in self._messages]

    def count_tokens(self, messages: list[dict[str, Any]]) -> int:
        """The prompt tokens `messages` make, from the engine's own chat template and tokenizer; a
        remote server's are not known here (an HTTP call per keystroke): about 4 characters a token."""
        engine = self._engine
        if engine.is_remote:
            return sum(len(str(m["content"])) for m in messages) // 4 + 4 * len(messages)
        text = engine.apply_chat_template(messages) if engine.chat_template else completion_prompt(messages)
        return len(engine.encode(text))

    def _fit(self, messages: list[dict[str, Any]]) -> int | None:
        """Plan the next request: how many oldest turns it leaves out (`_left_out`) and its max
        tokens (`_max_tokens`), so that the prompt fits the context with room for a reply: max
        tokens, or a quarter of the context when max tokens is more (the reply is then cut to what
        is left). Returns the prompt's tokens (None: not counted). Raises `ContextOverflowError`
        under the `stop` policy, or when even the last message alone is too long."""
        self._left_out, self._max_tokens = 0, None
        # The KV pool, when smaller than the context, is what a request can really get.
        context = min((n for n in (self._engine.max_model_len, self.kv_pool_tokens) if n), default=0)
        if not context:
            return None  # a remote server that does not say: it answers for itself
        settings = self.chat.settings
        budget = context - min(settings.max_tokens, context // 4)
        if settings.context_overflow == OVERFLOW_STOP:
            used = self.count_tokens(messages)
            if used > budget:
                raise ContextOverflowError(overflow_message(used, budget, context), used, budget)
        else:
            kept, used = drop_oldest_turns(messages, self.count_tokens, budget)
            self._left_out = len(turn_starts(messages)) - len(turn_starts(kept))
        if used + settings.max_tokens > context:
            self._max_tokens = context - used
        return used

    def request(self) -> tuple[Prompt, SamplingParams]:
        """What the next reply is generated from: the chat messages for a model with a chat
        template; for a base model (`engine.chat_template` False) the plain-text transcript
        (`completion_prompt`) with BASE_MODEL_STOP added to the stop strings."""
        params = self.chat.settings.to_params()
        if self._max_tokens is not None:
            params = replace(params, max_tokens=self._max_tokens)
        history = without_turns(self.history(), self._left_out)
        if self._engine.chat_template:
            return history, params
        return completion_prompt(history), replace(params, stop=[*(params.stop or []), BASE_MODEL_STOP])

    # layout

    def compose(self) -> ComposeResult:
        # The form itself is mounted on first use: a dozen widgets per tab slow tab creation down.
        yield SettingsTitle(self._settings_title(), classes="settings-title")
        # The history is mounted when the tab is first shown, newest page first (see _show_older).
        # Not focusable: a focusable history took the focus for a moment on every tab switch (the
        # shown tab's first focusable), and restyling its ~130 widgets on focus and again on blur
        # was most of the switch. The wheel scrolls it; keys: shift+pageup / shift+pagedown.
        yield ChatScroll(classes="messages", can_focus=False)
        yield AttachmentsLine(classes="attachments")
        yield PromptInput(recall=self.recall_prompts, classes="prompt")
        yield ContextMeter(classes="context-meter")

    def action_scroll_history(self, pages: int) -> None:
        scroll = self.query_one(".messages", VerticalScroll)
        (scroll.scroll_page_down if pages > 0 else scroll.scroll_page_up)(animate=False)

    def on_mount(self) -> None:
        # Anchored: follows new output only while the view is at the bottom.
        self.query_one(".messages", VerticalScroll).anchor()

    async def on_show(self) -> None:
        self._ensure_history()
        if self._context_tokens is None:
            self.refresh_meter(recount=True)
        await self.paint_reply()  # a tab shown mid-reply paints what it buffered while hidden

    def _ensure_history(self) -> None:
        if self._first_mounted is None:
            self._first_mounted = len(self._messages)
            self._show_older(HISTORY_PAGE)

    def _show_older(self, count: int) -> None:
        """Mount up to `count` more of the oldest unmounted messages above the mounted ones: a
        Markdown view per message costs a parse and a layout, too much for hundreds at once."""
        scroll = self.query_one(".messages", VerticalScroll)
        end = self._first_mounted
        self._first_mounted = start = max(end - count, 0)
        views = [MessageView(m.role, _shown(m), reply_meta(m)) for m in self._messages[start:end]]
        for old in scroll.query(EarlierMessages):
            old.remove()
        if start:
            views.insert(0, EarlierMessages(start))
        if views:
            scroll.mount_all(views, before=0 if scroll.children else None)

    def on_earlier_messages_pressed(self, event: EarlierMessages.Pressed) -> None:
        event.stop()
        self._show_older(HISTORY_PAGE)

    def reveal_message(self, index: int) -> None:
        """Show message `index` (a search hit): mount the pages of history down to it, scroll it
        to the top of the view and mark it for a moment so the eye finds it."""
        if not 0 <= index < len(self._messages):
            return
        self._ensure_history()
        if index < self._first_mounted:
            pages = -(-(self._first_mounted - index) // HISTORY_PAGE)
            self._show_older(pages * HISTORY_PAGE)
        scroll = self.query_one(".messages", VerticalScroll)
        view = list(scroll.query_children(MessageView))[index - self._first_mounted]
        view.add_class("hit")
        self.set_timer(HIT_MARK_S, lambda: view.remove_class("hit"))
        self._scroll_to(view)

    def _scroll_to(self, view: MessageView, tries: int = 10) -> None:
        """Scroll `view` to the top once it is laid out (a page just mounted is not, yet)."""
        if not view.virtual_region.size and tries:
            self.call_after_refresh(self._scroll_to, view, tries - 1)
            return
        self.query_one(".messages", VerticalScroll).scroll_to_widget(view, animate=False, top=True)

    async def paint_reply(self) -> None:
        """Paint what the reply buffered since the last paint; the screen's frame clock calls this
        for the tab that is shown (a hidden tab keeps buffering)."""
        if self._writer is not None and self.display:
            await self._writer.flush()

    def _settings_title(self) -> Text:
        prompt = "system prompt · " if self.chat.system_prompt.strip() else ""
        return Text.assemble(("⚙ ", "bold"), f"{prompt}{self.chat.settings.summary()}", (f"  ({self._settings_key})", "dim"))

    def focus_input(self) -> None:
        self.query_one(PromptInput).focus()

    def toggle_settings(self) -> None:
        forms = self.query(SettingsForm)
        if not forms:
            form = SettingsForm(self.chat.system_prompt, self.chat.settings)
            self.mount(form, after=self.query_one(".settings-title"))
            form.call_after_refresh(form.focus_first)
            return
        form = forms.first()
        form.display = not form.display
        if form.display:
            form.focus_first()
        else:
            self.focus_input()

    def on_settings_title_pressed(self, event: SettingsTitle.Pressed) -> None:
        event.stop()
        self.toggle_settings()

    def on_settings_form_changed(self, event: SettingsForm.Changed) -> None:
        self.chat = replace(self.chat, system_prompt=event.system_prompt, settings=event.settings)
        self._store.update_chat(self.chat)
        self.query_one(SettingsTitle).update(self._settings_title())

    def toggle_json_mode(self) -> bool:
        """Flip this tab's JSON mode (the palette's command); returns the new state."""
        settings = replace(self.chat.settings, json_mode=not self.chat.settings.json_mode)
        self.chat = replace(self.chat, settings=settings)
        self._store.update_chat(self.chat)
        self.query_one(SettingsTitle).update(self._settings_title())
        for form in self.query(SettingsForm):  # a form opened earlier shows the old state
            form.remove()
        return settings.json_mode

    def rename(self, title: str) -> None:
        self.chat = replace(self.chat, title=title)
        self._store.update_chat(self.chat)
        self.post_message(self.Changed(self))

    # sending

    def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        event.stop()
        self.send_input()

    def input_text(self) -> str:
        return self.query_one(PromptInput).text

    def clear_input(self) -> None:
        self.query_one(PromptInput).clear()

    def load_input(self, text: str) -> None:
        self.query_one(PromptInput).load_text(text)

    # attachments, the context meter, prompt history, taking a turn back

    @property
    def attachments(self) -> list[Attachment]:
        return list(self._attachments)

    def set_attachments(self, attachments: list[Attachment]) -> None:
        self._attachments = list(attachments)
        self.query_one(AttachmentsLine).show_files(self._attachments)
        self.refresh_meter()

    def attach(self, paths: list[str]) -> list[str]:
        """Add files for the next message; returns the one-line reasons of those refused."""
        errors = []
        for path in paths:
            try:
                file = read_attachment(path)
            except LocalbatchError as e:
                errors.append(str(e))
                continue
            self._attachments = [a for a in self._attachments if a.name != file.name] + [file]
        self.set_attachments(self._attachments)
        return errors

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
        meter = self.query_one(ContextMeter)
        draft = self.input_text().strip()
        try:
            if recount or self._context_tokens is None:
                self._context_tokens = self.count_tokens(self.history()) if self._messages or self.chat.system_prompt else 0
            adding = 0
            if draft or self._attachments:
                adding = self.count_tokens([{"role": "user", "content": compose_message(self._with_mentions(draft), draft)}])
        except LocalbatchError as e:  # a template the engine cannot render, a closed engine: said, not raised
            meter.show_hint(f"cannot count this chat's tokens: {first_line(e)}")
            return
        context = self._engine.max_model_len
        meter.show_usage(self._context_tokens, adding, context, self.kv_pool_tokens, self.prefill_rate,
                         approximate=self._engine.is_remote, left_out=self._left_out_messages())
        self._warn_if_nearly_full(context)

    def _with_mentions(self, text: str, strict: bool = False) -> list[Attachment]:
        """The attached files and those `text` names as `@path`; one that cannot be read raises
        when `strict` (sending), else is left out (the meter, as it is typed)."""
        files = list(self._attachments)
        for path in mentioned_files(text):
            if any(a.name == path for a in files):
                continue
            try:
                files.append(read_attachment(path))
            except LocalbatchError:
                if strict:
                    raise
        return files

    def _warn_if_nearly_full(self, context: int) -> None:
        """Once per chat, past 80%: say what happens at 100% (the chosen overflow policy)."""
        used = self._context_tokens or 0
        if not context or used < 0.8 * context or self._warned_full:
            return
        self._warned_full = True
        then = ("new messages are refused (stop policy)" if self.chat.settings.context_overflow == OVERFLOW_STOP
                else "the oldest turns are left out of what the model reads")
        self.app.notify(f"“{self.chat.title}” uses {used / context:.0%} of its {context:,}-token context; when it is "
                        f"full, {then}. Settings ({self._settings_key}) choose.", title="Context", severity="warning",
                        timeout=10)

    def _left_out_messages(self) -> int:
        """How many of the oldest messages the last request went without (0: none)."""
        if not self._left_out:
            return 0
        history = self.history()
        return len(history) - len(without_turns(history, self._left_out))

    def _left_out_note(self) -> str:
        dropped = self._left_out_messages()
        return f" · {dropped} oldest message{'s' * (dropped != 1)} left out to fit the context" if dropped else ""

    def recall_prompts(self) -> list[str]:
        """Prompts sent before, newest first: this tab's, then every other chat's (the store's)."""
        own = [split_message(m.content)[1] for m in reversed(self._messages) if m.role == "user"]
        others = self._store.recent_prompts()
        seen: set[str] = set()
        out = []
        for text in own + [split_message(t)[1] for t in others]:
            if text and text not in seen:
                seen.add(text)
                out.append(text)
        return out

    def take_back_last_turn(self) -> bool:
        """Remove the last user message and the replies after it, from the store and the view, and
        put the message (its files as attachments) back in the input to edit and resend. False
        while a reply runs or when there is no user message."""
        users = [i for i, m in enumerate(self._messages) if m.role == "user"]
        if self.generating or not users:
            return False
        self._ensure_history()
        self._release_reply_space()
        self._drop_failed_views()
        start = users[-1]
        taken, self._messages = self._messages[start:], self._messages[:start]
        views = self._stored_views()
        for view in views[len(views) - len(taken):]:
            view.remove()
        for message in taken:
            self._store.delete_message(message.id)
        self._first_mounted = min(self._first_mounted or 0, len(self._messages))
        self.load_message(taken[0].content)
        return True

    def _stored_views(self) -> list[MessageView]:
        """The mounted views of stored messages, oldest first (a failed attempt's view is none)."""
        return [view for view in self.query(MessageView) if not view.has_class("failed")]

    def _drop_failed_views(self) -> None:
        """Remove an earlier attempt's error view: it was never stored."""
        for failed in self.query(".message.failed"):
            failed.remove()

    def load_message(self, content: str) -> None:
        """A stored user message into the input: its files as attachments, its text to edit."""
        files, text = split_message(content)
        self.load_input(text)
        self.set_attachments(files)
        self.refresh_meter(recount=True)
        self.focus_input()

    def send_input(self) -> bool:
        if self.send(self.input_text()):
            self.clear_input()
            return True
        return False

    def send(self, text: str) -> bool:
        """Add a user message (the attached files first) and start the reply; False (nothing sent,
        the input kept) while a reply is running, or when a file or the context says no (a notice)."""
        text = text.strip()
        if not text or self.generating:
            return False
        try:
            content = compose_message(self._with_mentions(text, strict=True), text)
            used = self._fit([*self.history(), {"role": "user", "content": content}])
        except LocalbatchError as e:
            self.app.notify(str(e), title="Not sent", severity="error", timeout=12)
            return False
        self._ensure_history()  # a broadcast may reach a tab that was never shown
        message = self._store.add_message(self.chat.id, "user", content)
        self._messages.append(message)
        # The meter's count, with this message: the one just made, unless turns were left out of it.
        self._context_tokens = None if self._left_out else used
        self.set_attachments([])
        shown = display_text(content)
        scroll = self.query_one(".messages", VerticalScroll)
        reply = self._reply_view(self._user_height(scroll, shown))
        mounted = scroll.mount_all([MessageView("user", shown), reply])  # together: one layout
        if _DEFAULT_TITLE.match(self.chat.title):
            self.rename(_title_from(text))
        self._start(reply, mounted)
        return True

    def _reply_view(self, above: int | None) -> MessageView:
        """A reply's view whose streaming body fills the view below the user's message, `above`
        lines high (None: not known), so the question stays at the top while the reply fills the
        screen below it, and a reply shorter than a screen never grows its body (a layout each time)."""
        scroll = self.query_one(".messages", VerticalScroll)
        room = scroll.scrollable_content_region.height - above - 2 if above is not None else 0  # role line, margin
        return MessageView("assistant", streaming=True, stream_height=room)

    def _user_height(self, scroll: VerticalScroll, text: str) -> int:
        """A user message's height once mounted (role line, wrapped text, margin), before it is."""
        width = scroll.scrollable_content_region.width - 2  # the body's padding
        return 2 + len(Text(text).wrap(self.app.console, width)) if width > 0 else 0

    def _hold_reply_space(self, view: MessageView) -> None:
        """A finished reply keeps its streaming height until the next message: a short reply in a
        screen-high body would otherwise shrink and scroll the chat under the reader's eyes."""
        view.styles.min_height = view.size.height
        self._held_view = view

    def _release_reply_space(self) -> None:
        if self._held_view is not None:
            self._held_view.styles.min_height = None
            self._held_view = None

    def regenerate(self) -> bool:
        """Drop the last reply (if any) and generate it again from the same history."""
        if self.generating or not self._messages:
            return False
        history = self.history()
        try:
            self._fit(history[:-1] if history[-1]["role"] == "assistant" else history)
        except LocalbatchError as e:
            self.app.notify(str(e), title="Not regenerated", severity="error", timeout=12)
            return True  # said: nothing more to say
        self._ensure_history()
        views = self._stored_views()
        if self._messages[-1].role == "assistant":
            last = self._messages.pop()
            self._store.delete_message(last.id)
            if views:
                views.pop().remove()
        reply = self._reply_view(_height_with_margin(views[-1]) if views else None)
        self._start(reply, self.query_one(".messages", VerticalScroll).mount(reply))
        return True

    def stop(self) -> bool:
        if not self.generating:
            return False
        self._stop_requested = True  # also covers a stop that lands before the stream has begun
        self._engine.abort(self.request_id)
        if self._streaming and self._worker is not None:
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

    def _start(self, reply: MessageView, mounted: Awaitable[None]) -> None:
        """Start the reply into `reply`, a view being `mounted`."""
        self._release_reply_space()
        self._drop_failed_views()  # the new reply replaces an earlier attempt's error
        self.request_id = f"chat{self.chat.id}-{uuid.uuid4().hex[:8]}"
        self.metrics = ReplyMetrics(started=time.monotonic())
        self.engine_figures = None
        self.cache_hit = None
        self.finish_reason = None
        self._stop_requested = False
        self._partial: MessageRecord | None = None  # this reply's row once committed
        self._committed_at = time.monotonic()
        self.post_message(self.Changed(self))
        work = self._generate(self.request_id, reply, mounted)
        self._worker = self.run_worker(work, group="generate", exit_on_error=False)

    async def _generate(self, request_id: str, view: MessageView, mounted: Awaitable[None]) -> None:
        await mounted
        writer = self._writer = ReplyWriter(view.markdown, view.stream)
        self._live_view = view
        try:
            finish, error = await self._consume(request_id, writer)
        finally:
            self._writer = None
            self._live_view = None
            self._reading = ""
        self._hold_reply_space(view)
        await writer.close()
        self._finish(view, writer.text, finish, error)

    async def _consume(self, request_id: str, writer: ReplyWriter) -> tuple[str, str | None]:
        """Buffer the reply for the painter; returns (finish_reason, error)."""
        metrics = self.metrics
        self._streaming = True
        deltas = None
        try:
            if self._stop_requested:
                return "abort", None
            prompt, params = self.request()
            deltas = self._engine.stream(prompt, params, request_id, max_delay_s=DELTA_MAX_DELAY_S)
            async for delta in deltas:
                if self._stop_requested:
                    return "abort", None
                now = time.monotonic()
                metrics.observe(delta, now)
                if self._reading and delta.token_ids:
                    self.show_reading("")
                writer.write(delta.text)
                if now - self._committed_at >= COMMIT_EVERY_S and writer.text:
                    self._commit(writer.text, STREAMING)
                    self._committed_at = now
                if delta.finish_reason:
                    return delta.finish_reason, delta.error
            return "stop", None
        except asyncio.CancelledError:
            # stop() cancelled us on purpose: the reply ends here and is still committed.
            asyncio.current_task().uncancel()
            return "abort", None
        except Exception as e:  # noqa: BLE001 — any engine failure ends this reply, not the app
            return "error", first_line(e)
        finally:
            self._streaming = False
            aclose = getattr(deltas, "aclose", None)
            if aclose is not None:
                await aclose()

    def show_reading(self, line: str) -> None:
        """Show the prompt's progress under the reply being generated ("" clears it); only before its
        first token, and only when the line changes (the panels poll once a second)."""
        view = self._live_view
        if view is None or line == self._reading or (line and self.metrics and self.metrics.num_tokens):
            return
        self._reading = line
        view.set_meta(line)

    def _commit(self, text: str, finish: str) -> MessageRecord:
        """The reply so far (`STREAMING`) or whole, in one write: inserted once, then updated."""
        metrics = self.metrics
        figures = {"finish_reason": finish, "num_tokens": metrics.num_tokens, "ttft_s": metrics.ttft_s,
                   "tokens_per_s": metrics.tokens_per_s}
        if self._partial is None:
            self._partial = self._store.add_message(self.chat.id, "assistant", text, model=self._engine.model_name,
                                                    **figures)
        else:
            self._partial = self._store.update_reply(self._partial, text, **figures)
        return self._partial

    def _finish(self, view: MessageView, text: str, finish: str, error: str | None) -> None:
        metrics = self.metrics
        if text:
            # Committed at once: a crash from here on loses nothing of this reply.
            self._messages.append(self._commit(text, finish))
        elif self._partial is not None:
            self._store.delete_message(self._partial.id)
        self._partial = None
        if error:
            view.set_meta(f"error: {error}", error=True)
            view.set_class(not text, "failed")
        elif text:
            hit = f" · prefix cache {self.cache_hit[0]}/{self.cache_hit[1]} prompt tok" if self.cache_hit else ""
            view.set_meta(metrics.summary(finish, self._engine.model_name) + hit + self._left_out_note())
        else:
            view.remove()
        self.finish_reason = finish
        self.request_id = None
        self._worker = None
        self.post_message(self.Changed(self))
        self.refresh_meter(recount=True)


def _shown(message: MessageRecord) -> str:
    """A message as its view shows it: a user's attached files as one line each."""
    return display_text(message.content) if message.role == "user" else message.content


def _height_with_margin(view: MessageView) -> int:
    margin = view.styles.margin
    return view.outer_size.height + margin.top + margin.bottom


def _title_from(text: str, limit: int = 28) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"
