"""The file picker (ctrl+o): type a path (tab completes) or walk the tree from the working
directory; each file chosen is read at once, so a binary or oversized one is refused here, with
its reason, before anything is sent."""

from __future__ import annotations

from pathlib import Path

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DirectoryTree, Input, Label

from app.engine.types.errors import LocalbatchError
from app.ui.attach import Attachment, complete, options_hint, read_attachment


class AttachDialog(ModalScreen["list[Attachment] | None"]):
    """Dismisses with the files to attach (those already attached first), or None (escape)."""

    BINDINGS = [
        Binding("escape", "cancel", "Cancel"),
        Binding("ctrl+o", "done", "Attach", priority=True),
    ]

    def __init__(self, attached: list[Attachment], cwd: Path | None = None) -> None:
        super().__init__(classes="dialog-screen")
        self._chosen = list(attached)
        self._cwd = cwd or Path.cwd()

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog attach-dialog"):
            yield Label("Attach files: they go first in your next message, as fenced blocks with their names",
                        classes="dialog-question")
            yield Input(placeholder="path (tab completes) · enter adds it · enter on an empty line attaches",
                        id="attach-path")
            yield DirectoryTree(self._cwd, id="attach-tree")
            yield Label("", id="attach-chosen", markup=False)
            yield Label("", id="attach-error", classes="settings-error", markup=False)

    def on_mount(self) -> None:
        self._show()
        self.query_one("#attach-path", Input).focus()

    def _show(self) -> None:
        names = ", ".join(a.name for a in self._chosen) or "none yet"
        self.query_one("#attach-chosen", Label).update(
            f"Attaching: {names}   (ctrl+o or enter on an empty line: done · backspace on an empty line: drop the last)")

    def add(self, path: str) -> bool:
        """Read and add one file; a refused one is said in the dialog (False)."""
        error = self.query_one("#attach-error", Label)
        try:
            file = read_attachment(path, self._cwd)
        except LocalbatchError as e:
            error.update(str(e))
            return False
        error.update("")
        self._chosen = [a for a in self._chosen if a.name != file.name] + [file]
        self._show()
        return True

    @on(Input.Submitted, "#attach-path")
    def _submitted(self, event: Input.Submitted) -> None:
        path = event.value.strip()
        if not path:
            self.action_done()
        elif self.add(path):
            event.input.value = ""

    @on(DirectoryTree.FileSelected)
    def _file_selected(self, event: DirectoryTree.FileSelected) -> None:
        path = event.path
        self.add(str(path.relative_to(self._cwd)) if path.is_relative_to(self._cwd) else str(path))

    def on_key(self, event: object) -> None:
        key = getattr(event, "key", "")
        field = self.query_one("#attach-path", Input)
        if self.focused is not field:
            return
        if key == "tab" and field.value:
            event.stop()  # type: ignore[attr-defined]
            event.prevent_default()  # type: ignore[attr-defined]
            self._complete(field)
        elif key == "backspace" and not field.value and self._chosen:
            self._chosen.pop()
            self._show()

    def _complete(self, field: Input) -> None:
        prefix, options = complete(field.value, self._cwd)
        if len(prefix) > len(field.value):
            field.value = prefix
            field.cursor_position = len(prefix)
        if len(options) != 1:
            self.query_one("#attach-error", Label).update(options_hint(options, 10))

    def action_done(self) -> None:
        self.dismiss(self._chosen)

    def action_cancel(self) -> None:
        self.dismiss(None)
