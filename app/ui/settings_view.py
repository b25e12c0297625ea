"""A tab's settings: the one-line summary of its system prompt and sampling, and under it the form,
mounted on first use (a click on the line or the settings key shows and hides it). The form's
valid values go to the tab's `ChatSession`; the line follows the session's settings."""

from __future__ import annotations

from collections.abc import Callable

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical

from app.ui.session.session import ChatSession
from app.ui.store import ChatRecord
from app.ui.widgets import SettingsForm, SettingsTitle


class ChatSettingsView(Vertical):
    DEFAULT_CSS = """
    ChatSettingsView {
        height: auto;
    }
    """

    def __init__(self, session: ChatSession, settings_key: str, focus_input: Callable[[], None], **kwargs: object) -> None:
        super().__init__(**kwargs)
        self._session = session
        self._settings_key = settings_key
        self._focus_input = focus_input  # where the focus goes when the form hides

    def compose(self) -> ComposeResult:
        # The form itself is mounted on first use: a dozen widgets per tab slow tab creation down.
        yield SettingsTitle(settings_title(self._session.chat, self._settings_key), classes="settings-title")

    def toggle(self) -> None:
        forms = self.query(SettingsForm)
        if not forms:
            form = SettingsForm(self._session.chat.system_prompt, self._session.chat.settings)
            self.mount(form)
            form.call_after_refresh(form.focus_first)
            return
        form = forms.first()
        form.display = not form.display
        if form.display:
            form.focus_first()
        else:
            self._focus_input()

    def settings_changed(self) -> None:
        """The session's settings changed (here or elsewhere: JSON mode toggled from the palette)."""
        chat = self._session.chat
        self.query_one(SettingsTitle).update(settings_title(chat, self._settings_key))
        for form in self.query(SettingsForm):  # one showing other values is stale
            if not form.shows(chat.system_prompt, chat.settings):
                form.remove()

    def on_settings_title_pressed(self, event: SettingsTitle.Pressed) -> None:
        event.stop()
        self.toggle()

    def on_settings_form_changed(self, event: SettingsForm.Changed) -> None:
        event.stop()
        self._session.update_settings(event.system_prompt, event.settings)


def settings_title(chat: ChatRecord, key: str) -> Text:
    prompt = "system prompt · " if chat.system_prompt.strip() else ""
    return Text.assemble(("⚙ ", "bold"), f"{prompt}{chat.settings.summary()}", (f"  ({key})", "dim"))
