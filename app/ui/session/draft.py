"""The next message while it is written: the files attached to it, and those its text names as
`@path` (read when it is sent, or counted as it is typed)."""

from __future__ import annotations

from collections.abc import Callable

from app.engine.types.errors import LocalbatchError
from app.ui.attach import Attachment, compose_message, mentioned_files, read_attachment


class Draft:
    """The attachments of a chat's next message; `changed` is called whenever they change."""

    def __init__(self, changed: Callable[[], None] = lambda: None) -> None:
        self._attachments: list[Attachment] = []
        self._changed = changed

    @property
    def attachments(self) -> list[Attachment]:
        return list(self._attachments)

    def set_attachments(self, attachments: list[Attachment]) -> None:
        self._attachments = list(attachments)
        self._changed()

    def attach(self, paths: list[str]) -> list[str]:
        """Add files (a file of the same name replaces the earlier one); returns the one-line
        reasons of those refused."""
        errors = []
        for path in paths:
            try:
                file = read_attachment(path)
            except LocalbatchError as e:
                errors.append(str(e))
                continue
            self._attachments = [a for a in self._attachments if a.name != file.name] + [file]
        self._changed()
        return errors

    def files(self, text: str, strict: bool = False) -> list[Attachment]:
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

    def message(self, text: str, strict: bool = False) -> str:
        """The message `text` makes with the files first (see `compose_message`)."""
        return compose_message(self.files(text, strict), text)
