"""The chat screen's actions: one table drives the key bindings (with ids, remappable from the
config's `[keymap]`), the footer and the command palette."""

from __future__ import annotations

from dataclasses import dataclass

from textual.binding import Binding


@dataclass(frozen=True)
class ChatAction:
    id: str  # binding id, the key in the config's [keymap]
    keys: str  # default keys, comma-separated alternatives
    title: str  # palette title (and footer label)
    help: str
    show: bool = True  # in the footer
    # Only for keys the inputs bind themselves (ctrl+w deletes a word, ctrl+pageup scrolls). A
    # priority binding runs before the focused input has processed earlier keys, so broadcast,
    # for one, must not be: pasting text and pressing ctrl+b would send half the text. Defaults
    # avoid TextArea's other keys (f7 select all, ctrl+e/ctrl+k edit) but f6 (select line), and
    # alt+letter, which a terminal sends as escape then the letter (Textual sees two keys).
    priority: bool = False


CHAT_ACTIONS: tuple[ChatAction, ...] = (
    ChatAction("new_tab", "ctrl+n", "New chat", "Open a new chat tab"),
    ChatAction("close_tab", "ctrl+w", "Close tab", "Close the current tab; the chat stays in the chat list", priority=True),
    ChatAction("delete_chat", "ctrl+delete", "Delete chat", "Delete the current chat and its messages (asks first)", show=False),
    ChatAction("chat_list", "ctrl+l", "Chats", "List every stored chat, search them all (full text), reopen one"),
    ChatAction("next_tab", "ctrl+pagedown,alt+right", "Next tab", "Switch to the next chat tab", show=False, priority=True),
    ChatAction("previous_tab", "ctrl+pageup,alt+left", "Previous tab", "Switch to the previous chat tab", show=False, priority=True),
    ChatAction("stop", "escape", "Stop", "Stop generating in the current tab"),
    ChatAction("stop_all", "f8", "Stop all", "Stop generating in every tab", show=False),
    ChatAction("regenerate", "ctrl+r", "Regenerate", "Generate the last reply again"),
    ChatAction("rename", "f2", "Rename", "Rename the current chat", show=False),
    ChatAction("broadcast", "ctrl+b", "Broadcast", "Send the input to every idle tab at once"),
    ChatAction("settings", "f3", "Settings", "Show or hide this chat's system prompt and sampling settings"),
    ChatAction("export", "f4", "Export", "Export this chat to a Markdown file", show=False),
    ChatAction("fork", "ctrl+f", "Fork", "Fork this chat into a new tab; its prompt reuses this chat's KV blocks"),
    ChatAction("fork_at", "ctrl+g", "Fork at…", "Fork this chat after a chosen message", show=False),
    ChatAction("copy_reply", "ctrl+s", "Copy reply", "Copy the last reply to the clipboard", show=False),
    ChatAction("copy_code", "ctrl+t", "Copy code", "Copy the last code block to the clipboard"),
    ChatAction("copy_pick", "f12", "Copy…", "Pick any message or code block of this chat to copy", show=False),
    ChatAction("attach", "ctrl+o", "Attach", "Attach files to the next message (also: type @path and tab)"),
    ChatAction("edit_last", "ctrl+up", "Edit last", "Take back your last message and its reply: the message returns to the input to edit and resend", show=False),
    ChatAction("edit_at", "f6", "Edit at…", "Edit an earlier message in a fork: the chat up to it in a new tab, the message in the input", show=False,
               priority=True),
    ChatAction("switch_model", "f5", "Model", "Switch the model: stops replies, keeps every chat"),
    ChatAction("toggle_endpoint", "f9", "Endpoint", "Start or stop the embedded OpenAI-compatible HTTP endpoint", show=False),
)

ACTION_IDS: tuple[str, ...] = tuple(a.id for a in CHAT_ACTIONS)


def chat_bindings() -> list[Binding]:
    return [
        Binding(a.keys, a.id, a.title, show=a.show, priority=a.priority, id=a.id, tooltip=a.help)
        for a in CHAT_ACTIONS
    ]


def effective_keys(keymap: dict[str, str]) -> dict[str, str]:
    """Binding id -> the keys in force (config override or default), for the palette's help text."""
    return {a.id: keymap.get(a.id, a.keys) for a in CHAT_ACTIONS}
