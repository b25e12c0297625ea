"""The chat screen's commands: one table (id, default keys, title, help, handler) that the key
bindings (remappable by id from the config's `[keymap]`), the footer and the command palette all
read. A command's handler is the function of its id in `chat_commands` (named, as Textual names
its actions: the config reads this table without the handlers and all they import); it takes the
screen and returns nothing, or a coroutine the screen runs as a worker."""

from __future__ import annotations

from dataclasses import dataclass

from textual.binding import Binding


@dataclass(frozen=True)
class Command:
    id: str  # binding id, the key in the config's [keymap]
    keys: str  # default keys, comma-separated alternatives; "": the palette only
    title: str  # palette title (and footer label)
    help: str
    show: bool = True  # in the footer
    # Only for keys the inputs bind themselves (ctrl+w deletes a word, ctrl+pageup scrolls). A
    # priority binding runs before the focused input has processed earlier keys, so broadcast,
    # for one, must not be: pasting text and pressing ctrl+b would send half the text. Defaults
    # avoid TextArea's other keys (f7 select all, ctrl+e/ctrl+k edit) but f6 (select line), and
    # alt+letter, which a terminal sends as escape then the letter (Textual sees two keys).
    priority: bool = False


COMMANDS: tuple[Command, ...] = (
    Command("new_tab", "ctrl+n", "New chat", "Open a new chat tab"),
    Command("close_tab", "ctrl+w", "Close tab", "Close the current tab; the chat stays in the chat list", priority=True),
    Command("delete_chat", "ctrl+delete", "Delete chat", "Delete the current chat and its messages (asks first)",
            show=False),
    Command("chat_list", "ctrl+l", "Chats", "List every stored chat, search them all (full text), reopen one"),
    Command("next_tab", "ctrl+pagedown,alt+right", "Next tab", "Switch to the next chat tab", show=False, priority=True),
    Command("previous_tab", "ctrl+pageup,alt+left", "Previous tab", "Switch to the previous chat tab", show=False,
            priority=True),
    Command("stop", "escape", "Stop", "Stop generating in the current tab"),
    Command("stop_all", "f8", "Stop all", "Stop generating in every tab", show=False),
    Command("regenerate", "ctrl+r", "Regenerate", "Generate the last reply again"),
    Command("rename", "f2", "Rename", "Rename the current chat", show=False),
    Command("broadcast", "ctrl+b", "Broadcast", "Send the input to every idle tab at once"),
    Command("settings", "f3", "Settings", "Show or hide this chat's system prompt and sampling settings"),
    Command("export", "f4", "Export", "Export this chat to a Markdown file", show=False),
    Command("fork", "ctrl+f", "Fork", "Fork this chat into a new tab; its prompt reuses this chat's KV blocks"),
    Command("fork_at", "ctrl+g", "Fork at…", "Fork this chat after a chosen message", show=False),
    Command("copy_reply", "ctrl+s", "Copy reply", "Copy the last reply to the clipboard", show=False),
    Command("copy_code", "ctrl+t", "Copy code", "Copy the last code block to the clipboard"),
    Command("copy_pick", "f12", "Copy…", "Pick any message or code block of this chat to copy", show=False),
    Command("attach", "ctrl+o", "Attach", "Attach files to the next message (also: type @path and tab)"),
    Command("edit_last", "ctrl+up", "Edit last", "Take back your last message and its reply: the message returns to the "
            "input to edit and resend", show=False),
    Command("edit_at", "f6", "Edit at…", "Edit an earlier message in a fork: the chat up to it in a new tab, the message "
            "in the input", show=False, priority=True),
    Command("switch_model", "f5", "Model", "Switch the model: stops replies, keeps every chat"),
    Command("toggle_endpoint", "f9", "Endpoint", "Start or stop the embedded OpenAI-compatible HTTP endpoint", show=False),
    Command("tools_view", "f10", "MCP servers and tools", "The MCP servers, their state and tools: turn a tool or a "
            "server off or on, restart a server", show=False),
    Command("toggle_tools", "f11", "Tools on/off", "Offer the MCP tools to the model in this tab, or not (kept with "
            "the chat's settings)", show=False),
    # The palette only.
    Command("send", "", "Send", "Send the input to the current tab (enter)"),
    Command("toggle_json", "", "JSON mode", "Constrain this tab's replies to JSON; a schema goes in its settings"),
    Command("search_chats", "", "Search chats", "Search the messages of every chat, open or closed (full text)"),
    Command("clear_kv_disk_cache", "", "Clear the KV disk cache", "Remove the KV blocks kept on disk across restarts "
            "(prompts read before are read again once)"),
)

# The commands with keys: what the config's [keymap] may rebind.
ACTION_IDS: tuple[str, ...] = tuple(c.id for c in COMMANDS if c.keys)


def command_bindings() -> list[Binding]:
    """The key bindings: each runs its command through the screen's `command` action."""
    return [
        Binding(c.keys, f"command('{c.id}')", c.title, show=c.show, priority=c.priority, id=c.id, tooltip=c.help)
        for c in COMMANDS if c.keys
    ]


def effective_keys(keymap: dict[str, str]) -> dict[str, str]:
    """Binding id -> the keys in force (config override or default), for the palette's help text."""
    return {c.id: keymap.get(c.id, c.keys) for c in COMMANDS if c.keys}


def palette_help(command: Command, keys: dict[str, str]) -> str:
    """A command's help in the palette, with the keys that run it."""
    bound = keys.get(command.id, "")
    return f"{command.help} ({bound.replace(',', ' / ')})" if bound else command.help
