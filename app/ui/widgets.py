"""Small widgets of a chat tab: the prompt input, one message, the settings form."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from rich.text import Text
from textual import events, on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Input, Label, Markdown, Static, Switch, TextArea

from app.engine.types.context_window import OVERFLOW_DROP_OLDEST, OVERFLOW_STOP
from app.engine.types.errors import RequestError
from app.tools.manager import PromptInfo
from app.ui.attach import Attachment, complete
from app.ui.session.prompts import complete_prompt
from app.ui.format import fmt_wait
from app.ui.layout_once import LaidOutOnce
from app.ui.reply_stream import TAIL_LINES, StreamingBody, chat_markdown_parser
from app.ui.user_config import ChatSettings

_NEWLINE_KEYS = ("shift+enter", "ctrl+j")
_ROLE_LINES = {"user": "You", "assistant": "Assistant", "tool": "Tool result", "note": "Note"}


class PromptInput(TextArea):
    """Multi-line input: enter sends, shift+enter or ctrl+j inserts a newline; up/down in an empty
    input walk the prompts sent before (`recall`); tab after `@` completes a file path."""

    class Submitted(Message):
        def __init__(self, prompt_input: PromptInput, text: str) -> None:
            super().__init__()
            self.prompt_input = prompt_input
            self.text = text

        @property
        def control(self) -> PromptInput:
            return self.prompt_input

    class Completions(Message):
        """Tab after `@` found several paths (or none): the tab shows them."""

        def __init__(self, options: list[str]) -> None:
            super().__init__()
            self.options = options

    def __init__(self, recall: Callable[[], list[str]] | None = None,
                 prompts: Callable[[], list[PromptInfo]] | None = None, **kwargs: object) -> None:
        super().__init__(
            soft_wrap=True,
            show_line_numbers=False,
            placeholder="Message — enter sends, ctrl+j adds a line, ↑ earlier prompts, @path + tab attaches a file",
            **kwargs,
        )
        # A blinking cursor repaints the input (and re-composites the screen around it) twice a
        # second, streaming or idle.
        self.cursor_blink = False
        self._recall = recall  # the prompts sent before, newest first
        self._prompts = prompts  # the MCP servers' prompts, completed after `/`
        self._recalled: list[str] | None = None  # that list while walking it
        self._recall_at = -1  # the entry shown; -1: the empty input the walk started from

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            if self.text.strip():
                self.post_message(self.Submitted(self, self.text))
            return
        if event.key in _NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        if event.key in ("up", "down") and self._walk(1 if event.key == "up" else -1):
            event.stop()
            event.prevent_default()
            return
        if event.key == "tab" and (self._complete_path() or self._complete_prompt()):
            event.stop()
            event.prevent_default()
            return
        await super()._on_key(event)

    def _walk(self, step: int) -> bool:
        """Show the next older (step 1) or newer (-1) sent prompt; False leaves the key to the
        editor: the input holds text that is not a recalled prompt (up moves the cursor there)."""
        walking = self._recalled is not None and self._recall_at >= 0 and self.text == self._recalled[self._recall_at]
        if not walking:
            if self.text or step < 0 or self._recall is None:
                return False
            self._recalled, self._recall_at = self._recall(), -1
        index = self._recall_at + step
        if index >= len(self._recalled):
            return True  # the oldest is shown: stay there
        self._recall_at = index
        self.load_text(self._recalled[index] if index >= 0 else "")
        self.move_cursor(self.document.end)
        return True

    def _complete_path(self) -> bool:
        """Complete the `@path` word before the cursor; False when there is none (tab then moves
        the focus, as it does elsewhere)."""
        row, col = self.cursor_location
        line = self.document.get_line(row)[:col]
        word = line.rsplit(None, 1)[-1] if line.strip() else ""
        if not word.startswith("@") or line.endswith(" "):
            return False
        completed, options = complete(word[1:])
        if len(options) == 1 or completed != word[1:]:
            self.insert(completed[len(word) - 1:] + (" " if len(options) == 1 and not completed.endswith("/") else ""))
        if len(options) != 1:
            self.post_message(self.Completions(options))
        return True


    def _complete_prompt(self) -> bool:
        """Complete a `/name` the input starts with (an MCP prompt); False when there is none."""
        row, col = self.cursor_location
        word = self.document.get_line(row)[:col]
        if row or not word.startswith("/") or " " in word or self._prompts is None:
            return False
        completed, options = complete_prompt(word[1:], self._prompts())
        if completed != word[1:] or len(options) == 1:
            self.insert(completed[len(word) - 1:] + (" " if len(options) == 1 else ""))
        if len(options) != 1:
            self.post_message(self.Completions(["/" + o for o in options]))
        return True


class AttachmentsLine(Static):
    """The files the next message carries, one line; hidden when there are none."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__("", markup=False, **kwargs)
        self.display = False

    def show_files(self, files: list[Attachment]) -> None:
        self.update("📎 " + " · ".join(f.chip() for f in files) + "   (ctrl+o to change)" if files else "")
        self.display = bool(files)


class ContextMeter(Static):
    """The line under the input: the chat's prompt tokens against the context (yellow from 80%),
    and what the message being written adds and costs to read."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__("", markup=False, **kwargs)
        self._usage = Text()

    def show_usage(self, used: int, adding: int, context: int, kv_pool: int, prefill_tok_s: float,
                   approximate: bool = False, left_out: int = 0) -> None:
        self._usage = usage_text(used, adding, context, kv_pool, prefill_tok_s, approximate, left_out)
        full = context and used + adding >= context
        self.set_class(bool(context) and used + adding >= 0.8 * context and not full, "warn")
        self.set_class(bool(full), "full")
        self.update(self._usage)

    def show_hint(self, hint: str) -> None:
        """A passing note (the paths a tab could complete) in place of the usage, until the next count."""
        self.update(Text(hint, style="italic"))


def usage_text(used: int, adding: int, context: int, kv_pool: int, prefill_tok_s: float,
               approximate: bool = False, left_out: int = 0) -> Text:
    """`left_out`: the oldest messages the last reply's prompt went without (the chat outgrew it)."""
    about = "≈" if approximate else ""
    text = Text(f"context {about}{used:,}")
    if context:
        text.append(f" / {context:,} tok · {used / context:.0%}")
        if kv_pool and kv_pool < context:
            text.append(f" · KV pool {kv_pool:,}")
    else:
        text.append(" tok")
    if left_out:
        text.append(f" · the model reads it without the oldest {left_out} message{'s' * (left_out != 1)}")
    if adding:
        text.append(f" · this message +{about}{adding:,} tok", style="bold")
        if prefill_tok_s > 0:
            text.append(f", ~{fmt_wait(adding / prefill_tok_s)} to read")
    return text


class ChatScroll(LaidOutOnce, VerticalScroll):
    """A chat's messages, scrolled. The scrollbar is there from the start: when the first reply
    to outgrow the view brought it, the messages narrowed by a column and re-wrapped (two more
    layouts of the screen)."""

    DEFAULT_CSS = """
    ChatScroll {
        overflow-y: scroll;
    }
    """


class MessageLine(LaidOutOnce, Label):
    """A message's role line or metadata line."""


class UserText(LaidOutOnce, Static):
    """The user's own message, as typed."""


class ReplyMarkdown(LaidOutOnce, Markdown):
    """A reply, rendered."""


class MessageView(LaidOutOnce, Vertical):
    """One message: a role line, the body (Markdown for replies, plain text for the user's own
    input) and a dim line of reply metadata."""

    def __init__(self, role: str, content: str = "", meta: str = "", streaming: bool = False,
                 stream_height: int = TAIL_LINES) -> None:
        super().__init__(classes=f"message {role}")
        self.role = role
        self._content = content
        self._meta = meta
        self._streaming = streaming  # a reply about to stream: its body shows from the start
        self._stream_height = stream_height  # its body's first height (see StreamingBody)

    def compose(self) -> ComposeResult:
        yield MessageLine(_ROLE_LINES.get(self.role, self.role), classes="role")
        if self.role == "assistant":
            yield ReplyMarkdown(self._content, classes="body", parser_factory=chat_markdown_parser)
            stream = StreamingBody(self._stream_height, classes="stream")  # the reply while it streams
            stream.display = self._streaming  # shown later, it would cost a layout of the screen
            yield stream
        else:
            yield UserText(self._content, markup=False, classes="body")
        meta = MessageLine(self._meta, markup=False, classes="meta")
        meta.display = bool(self._meta)
        yield meta

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    @property
    def stream(self) -> StreamingBody:
        return self.query_one(StreamingBody)

    def set_meta(self, text: str, *, error: bool = False) -> None:
        label = self.query_one(".meta", Label)
        label.update(text)
        label.set_class(error, "error")
        label.display = bool(text)


class EarlierMessages(Static):
    """A line above a long chat's mounted messages: how many older ones there are; a click (or
    enter, when focused) mounts another page of them."""

    can_focus = True

    class Pressed(Message):
        """Clicked (or enter when focused)."""

    def __init__(self, count: int) -> None:
        noun = "message" if count == 1 else "messages"
        super().__init__(f"▲ {count} earlier {noun} · click to show", markup=False, classes="earlier")

    def on_click(self) -> None:
        self.post_message(self.Pressed())

    def key_enter(self) -> None:
        self.post_message(self.Pressed())


class SettingsTitle(Static):
    """The one-line summary of a chat's settings; a click opens the form."""

    class Pressed(Message):
        """Clicked (or enter when focused)."""

    def on_click(self) -> None:
        self.post_message(self.Pressed())


class SettingsForm(Vertical):
    """A chat's system prompt and sampling settings; posts `Changed` with valid values only."""

    class Changed(Message):
        def __init__(self, system_prompt: str, settings: ChatSettings) -> None:
            super().__init__()
            self.system_prompt = system_prompt
            self.settings = settings

    _FIELDS = (
        ("temperature", "temperature", "number"),
        ("top_p", "top-p", "number"),
        ("max_tokens", "max tokens", "integer"),
        ("seed", "seed", "integer"),
    )

    def __init__(self, system_prompt: str, settings: ChatSettings) -> None:
        super().__init__(classes="settings-form")
        self._system_prompt = system_prompt
        self._settings = settings

    def compose(self) -> ComposeResult:
        yield Label("System prompt", classes="field-label")
        yield TextArea(self._system_prompt, soft_wrap=True, classes="system-prompt")
        with Horizontal(classes="sampling-row"):
            for name, title, kind in self._FIELDS:
                value = getattr(self._settings, name)
                with Vertical(classes="field"):
                    yield Label(title, classes="field-label")
                    yield Input("" if value is None else str(value), type=kind, classes=f"setting {name}", compact=True)
        with Horizontal(classes="json-row"):
            yield Switch(self._settings.json_mode, classes="json-mode", tooltip="Constrain replies to JSON")
            yield Label("JSON mode · optional JSON schema below (empty: any JSON object)", classes="field-label")
        yield TextArea(self._settings.json_schema, soft_wrap=True, classes="json-schema", language=None)
        with Horizontal(classes="json-row"):
            yield Switch(self._settings.context_overflow == OVERFLOW_DROP_OLDEST, classes="drop-oldest",
                         tooltip="When a message would overflow the context")
            yield Label("When the context is full, leave the oldest turns out (off: stop and say so)",
                        classes="field-label")
        yield Label("", classes="settings-error")

    def focus_first(self) -> None:
        self.query_one(".system-prompt", TextArea).focus()

    def shows(self, system_prompt: str, settings: ChatSettings) -> bool:
        """Whether the form holds these values (a change made elsewhere leaves it stale)."""
        return (self._system_prompt, self._settings) == (system_prompt, settings)

    def read(self) -> ChatSettings:
        """The form's settings; raises `RequestError` naming the first bad field."""
        values: dict[str, object] = {}
        for name, title, kind in self._FIELDS:
            raw = self.query_one(f".setting.{name}", Input).value.strip()
            if name == "seed" and not raw:
                values[name] = None
                continue
            try:
                values[name] = int(raw) if kind == "integer" else float(raw)
            except ValueError:
                raise RequestError(f"{title} must be a number", param=name) from None
        values["json_mode"] = self.query_one(".json-mode", Switch).value
        values["json_schema"] = self.query_one(".json-schema", TextArea).text
        values["context_overflow"] = OVERFLOW_DROP_OLDEST if self.query_one(".drop-oldest", Switch).value else OVERFLOW_STOP
        settings = replace(self._settings, **values)
        settings.validate()
        return settings

    @on(Input.Changed, ".setting")
    @on(TextArea.Changed, ".system-prompt")
    @on(TextArea.Changed, ".json-schema")
    @on(Switch.Changed, ".json-mode")
    @on(Switch.Changed, ".drop-oldest")
    def _changed(self, event: Message) -> None:
        event.stop()
        error = self.query_one(".settings-error", Label)
        try:
            settings = self.read()
        except RequestError as e:
            error.update(str(e))
            return
        error.update("")
        system_prompt = self.query_one(".system-prompt", TextArea).text
        if settings != self._settings or system_prompt != self._system_prompt:
            self._settings, self._system_prompt = settings, system_prompt
            self.post_message(self.Changed(system_prompt, settings))


class StableFooter(Footer):
    """A footer that rebuilds only when the keys it shows change. Textual's rebuilds (new key
    widgets, restyled) on every focus change: a quarter of a tab switch's time, for the same keys."""

    _shown: tuple | None = None

    def bindings_changed(self, screen: Screen) -> None:
        shown = tuple(
            (binding.key, binding.description, binding.action, enabled)
            for _, binding, enabled, _ in screen.active_bindings.values()
            if binding.show
        )
        if shown != self._shown or not self.children:
            self._shown = shown
            super().bindings_changed(screen)
