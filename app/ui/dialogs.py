"""Modal dialogs: confirm a deletion, rename a chat."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label


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
