"""Modal dialogs: confirm a deletion, rename a chat, pick a model, a message, or what to copy."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList
from textual.widgets.option_list import Option

from app.ui.attach import display_text
from app.ui.clipboard import Copyable, code_blocks
from app.ui.store import MessageRecord


# A message's role as the pickers name it, and what a copy of it is called.
_ROLES = {"user": ("You", "your message"), "assistant": ("Assistant", "the reply"), "tool": ("Tool", "the tool's result")}


class ConfirmDialog(ModalScreen[bool]):
    """Yes/no; dismisses with True only when the confirm button is chosen."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("y", "confirm", "Yes", show=False)]

    def __init__(self, question: str, confirm_label: str = "Delete") -> None:
        super().__init__(classes="dialog-screen")
        self._question = question
        self._confirm_label = confirm_label

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self._question, classes="dialog-question")
            with Horizontal(classes="dialog-buttons"):
                yield Button(self._confirm_label, variant="error", id="confirm")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.query_one("#cancel", Button).focus()

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "confirm")

    def action_confirm(self) -> None:
        self.dismiss(True)

    def action_cancel(self) -> None:
        self.dismiss(False)


class RenameDialog(ModalScreen["str | None"]):
    """Asks for a new title; dismisses with None when cancelled or left empty."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str) -> None:
        super().__init__(classes="dialog-screen")
        self._title = title

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("Rename chat", classes="dialog-question")
            yield Input(self._title, id="title", select_on_focus=True)

    @on(Input.Submitted)
    def _submitted(self, event: Input.Submitted) -> None:
        title = " ".join(event.value.split())
        self.dismiss(title or None)

    def action_cancel(self) -> None:
        self.dismiss(None)


class ModelPicker(ModalScreen["str | None"]):
    """Choose the model to switch to: a catalog entry or a GGUF file path. Entries not pulled yet
    are listed with their size: choosing one pulls it in the background (the current model keeps
    serving). Dismisses with the choice or None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, entries: list[tuple[str, str, bool]], current: str, sizes: dict[str, str] | None = None,
                 pulling: str | None = None) -> None:
        super().__init__(classes="dialog-screen")
        self._entries = entries
        self._current = current
        self._sizes = sizes or {}
        self._pulling = pulling

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog model-picker"):
            yield Label(f"Switch model (now: {self._current}); every chat is kept", classes="dialog-question")
            yield OptionList(*(self._option(*entry) for entry in self._entries), id="models")
            yield Input(placeholder="…or the path of a GGUF file, then enter", id="model-path")

    def _option(self, name: str, description: str, ready: bool) -> Option:
        marker = "● " if name == self._current else "  "
        size = self._sizes.get(name, "")
        if name == self._pulling:
            note = "pulling now (progress in the side panel)"
        elif ready:
            note = description
        else:
            note = f"not pulled ({size}): enter pulls it, the current model keeps serving"
        return Option(f"{marker}{name}\n    {note}", id=name, disabled=name == self._pulling)

    def on_mount(self) -> None:
        self.query_one(OptionList).focus()

    @on(OptionList.OptionSelected)
    def _selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    @on(Input.Submitted)
    def _path(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)

    def action_cancel(self) -> None:
        self.dismiss(None)


class MessagePicker(ModalScreen["int | None"]):
    """Choose a message (the one a fork ends at, or one of yours to edit); dismisses with its
    index in the chat, or None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, messages: list[MessageRecord], roles: tuple[str, ...] = ("user", "assistant"),
                 question: str = "Fork this chat after which message?") -> None:
        super().__init__(classes="dialog-screen")
        self._messages = messages
        self._roles = roles
        self._question = question

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog model-picker"):
            yield Label(self._question, classes="dialog-question")
            yield OptionList(*(self._option(i, m) for i, m in enumerate(self._messages) if m.role in self._roles),
                             id="messages")

    @staticmethod
    def _option(index: int, message: MessageRecord) -> Option:
        role = _ROLES.get(message.role, ("Assistant", ""))[0]
        line = " ".join(display_text(message.content).split())
        return Option(f"{index + 1}. {role}: {line[:60]}{'…' if len(line) > 60 else ''}", id=str(index))

    def on_mount(self) -> None:
        options = self.query_one(OptionList)
        options.highlighted = options.option_count - 1
        options.focus()

    @on(OptionList.OptionSelected)
    def _selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(int(event.option.id))

    def action_cancel(self) -> None:
        self.dismiss(None)


class CopyPicker(ModalScreen["Copyable | None"]):
    """Choose a message, or a code block of a reply, to copy: newest first, each reply's blocks
    under it. Starts on the newest code block (what is copied most), else on the newest reply."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, messages: list[MessageRecord]) -> None:
        super().__init__(classes="dialog-screen")
        self._items: list[tuple[str, Copyable]] = []
        for message in reversed(messages):
            role, what = _ROLES.get(message.role, _ROLES["assistant"])
            self._items.append((f"{role}: {_first_line(message.content)}", Copyable(message.content, what=what)))
            if message.role == "assistant":
                for block in code_blocks(message.content):
                    label = f"    {block.language or 'code'} · {block.lines} line{'s' * (block.lines != 1)} · "
                    self._items.append((label + _first_line(block.code, 40), Copyable(block.code, block.language)))

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog model-picker"):
            yield Label("Copy which message or code block?", classes="dialog-question")
            options = (Option(label, id=str(i)) for i, (label, _) in enumerate(self._items))
            yield OptionList(*options, id="copyables", markup=False)

    def _start(self) -> int:
        """The newest code block: the last block under the first reply (newest first) with any."""
        blocks = [i for i, (_, item) in enumerate(self._items) if item.language is not None]
        if not blocks:
            replies = [i for i, (_, item) in enumerate(self._items) if item.what == "the reply"]
            return replies[0] if replies else 0
        first = blocks[0]
        while first + 1 < len(self._items) and self._items[first + 1][1].language is not None:
            first += 1
        return first

    def on_mount(self) -> None:
        options = self.query_one(OptionList)
        if self._items:
            options.highlighted = self._start()
        options.focus()

    @on(OptionList.OptionSelected)
    def _selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self._items[int(event.option.id)][1])

    def action_cancel(self) -> None:
        self.dismiss(None)


def _first_line(text: str, limit: int = 60) -> str:
    line = next((" ".join(part.split()) for part in text.splitlines() if part.strip()), "")
    return f"{line[:limit]}{'…' if len(line) > limit else ''}"
