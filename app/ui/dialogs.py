"""Modal dialogs: confirm a deletion, rename a chat, pick a model."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList
from textual.widgets.option_list import Option

from app.ui.store import MessageRecord


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
    """Choose the message a fork ends at; dismisses with its index, or None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, messages: list[MessageRecord]) -> None:
        super().__init__(classes="dialog-screen")
        self._messages = messages

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog model-picker"):
            yield Label("Fork this chat after which message?", classes="dialog-question")
            yield OptionList(*(self._option(i, m) for i, m in enumerate(self._messages)), id="messages")

    @staticmethod
    def _option(index: int, message: MessageRecord) -> Option:
        role = "You" if message.role == "user" else "Assistant"
        line = " ".join(message.content.split())
        return Option(f"{index + 1}. {role}: {line[:60]}{'…' if len(line) > 60 else ''}", id=str(index))

    def on_mount(self) -> None:
        options = self.query_one(OptionList)
        options.highlighted = len(self._messages) - 1
        options.focus()

    @on(OptionList.OptionSelected)
    def _selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(int(event.option.id))

    def action_cancel(self) -> None:
        self.dismiss(None)
