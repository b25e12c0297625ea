"""What the chat screen's commands do: the handler of each command of `commands.COMMANDS`, named
by its id. A handler takes the screen, works on its shown tab's `ChatSession` and view, and says
what happened in a notice; one that must wait (a tab opening) returns a coroutine, one that asks
first (a dialog) schedules its work with the answer."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from app.engine.api.engine_client import EngineClient
from app.engine.types.errors import LocalbatchError
from app.ui.attach import Attachment
from app.ui.attach_dialog import AttachDialog
from app.ui.chat import ChatPane
from app.ui.chat_list import ChatListScreen
from app.ui.clipboard import Copyable, code_blocks, copy_text
from app.ui.dialogs import ConfirmDialog, CopyPicker, MessagePicker, ModelPicker, RenameDialog
from app.ui.export import export_chat
from app.ui.loading import EngineInfo
from app.ui.sidebar import Sidebar
from app.ui.store import ChatRecord, ChatStore
from app.ui.tools_view import ToolsScreen


class ChatScreen(Protocol):
    """What the handlers use of the chat screen (`screen.ChatScreen`)."""

    app: Any
    engine: EngineClient
    store: ChatStore
    info: EngineInfo
    sidebar: Sidebar
    export_dir: Callable[[], Path]

    def active_pane(self) -> ChatPane | None: ...
    def panes(self) -> list[ChatPane]: ...
    def cycle(self, step: int) -> None: ...
    async def new_tab(self) -> None: ...
    async def open(self, chat: ChatRecord) -> ChatPane: ...
    async def close(self, pane: ChatPane) -> None: ...
    async def delete(self, pane: ChatPane) -> None: ...
    async def show_chat(self, chat_id: int, message_index: int | None = None) -> None: ...
    async def delete_chat_by_id(self, chat_id: int) -> None: ...
    def notify(self, message: str, **kwargs: Any) -> None: ...
    def run_worker(self, work: Awaitable[None], **kwargs: Any) -> Any: ...


# tabs

def new_tab(screen: ChatScreen) -> Awaitable[None]:
    return screen.new_tab()


def next_tab(screen: ChatScreen) -> None:
    screen.cycle(1)


def previous_tab(screen: ChatScreen) -> None:
    screen.cycle(-1)


def close_tab(screen: ChatScreen) -> None:
    """Close the tab and keep its chat (the chat list reopens it): nothing is lost, so no
    question. An empty chat is deleted: there is nothing to list."""
    pane = screen.active_pane()
    if pane is None:
        return
    if not pane.session.messages and not pane.generating:
        screen.run_worker(screen.delete(pane), group="tabs")
    elif screen.store.write_error is not None:
        delete_chat(screen)  # chats held only in memory: a closed one could not be listed
    else:
        screen.run_worker(screen.close(pane), group="tabs")


def delete_chat(screen: ChatScreen) -> None:
    pane = screen.active_pane()
    if pane is None:
        return
    if not pane.session.messages and not pane.generating:
        screen.run_worker(screen.delete(pane), group="tabs")
        return
    question = f"Delete “{pane.session.chat.title}” and its {len(pane.session.messages)} messages?"

    def answered(confirmed: bool | None) -> None:
        if confirmed:
            screen.run_worker(screen.delete(pane), group="tabs")

    screen.app.push_screen(ConfirmDialog(question), answered)


def chat_list(screen: ChatScreen, query: str = "", search: bool = False) -> None:
    """Every chat, open or closed, and a search over all their messages: the chosen one opens
    in a tab (or its tab is shown), at the chosen message."""

    def chosen(target: tuple[int, int | None] | None) -> None:
        if target is not None:
            screen.run_worker(screen.show_chat(*target), group="tabs")

    screen.app.push_screen(ChatListScreen(screen.store, screen.delete_chat_by_id, query, search), chosen)


def search_chats(screen: ChatScreen) -> None:
    chat_list(screen, search=True)


def fork(screen: ChatScreen, upto: int | None = None) -> Awaitable[None] | None:
    """A new tab with this chat's history (up to message index `upto`, else all of it). Its
    next prompt starts with the same tokens, so the prefix cache serves them: no recompute
    while this chat's blocks are held or still cached."""
    pane = screen.active_pane()
    return _fork(screen, pane, upto) if pane is not None else None


async def _fork(screen: ChatScreen, pane: ChatPane, upto: int | None) -> None:
    session = pane.session
    chat, copied = session.fork(upto)
    await screen.open(chat)
    screen.notify(f"Forked “{session.chat.title}” at message {copied} of {len(session.messages)}")


def fork_at(screen: ChatScreen) -> None:
    pane = screen.active_pane()
    if pane is None or not pane.session.messages:
        screen.notify("Nothing to fork at yet", severity="warning")
        return

    def chosen(index: int | None) -> None:
        if index is not None:
            screen.run_worker(_fork(screen, pane, index), group="tabs")

    screen.app.push_screen(MessagePicker(pane.session.messages), chosen)


def switch_model(screen: ChatScreen) -> None:
    app = screen.app
    if screen.engine.is_remote:
        screen.notify("The remote server chooses the model; run without --backend-url to switch models here.",
                      severity="warning")
        return
    from app.engine.gguf.catalog import CATALOG, picker_entries

    entries = picker_entries()
    ready = {name: ok for name, _, ok in entries}
    state = getattr(app, "pulling", None)
    pulling = state.name if state is not None and not state.done else None

    def chosen(target: str | None) -> None:
        if target and target in ready and not ready[target]:
            app.pull_model(target)
        elif target and target != screen.info.model_name:
            # The app's worker, not this screen's: the switch replaces this screen.
            app.run_worker(app.switch_model(target), group="switch-model", exclusive=True)

    sizes = {e.name: f"{e.size / 1e9:.1f} GB" if e.size >= 1e9 else f"{e.size / 1e6:.0f} MB" for e in CATALOG.values()}
    app.push_screen(ModelPicker(entries, screen.info.model_name, sizes, pulling), chosen)


def toggle_endpoint(screen: ChatScreen) -> None:
    screen.run_worker(screen.sidebar.toggle_endpoint(), group="endpoint", exclusive=True)


# generation

def send(screen: ChatScreen) -> None:
    pane = screen.active_pane()
    if pane is not None:
        pane.send_input()


def broadcast(screen: ChatScreen) -> None:
    active = screen.active_pane()
    text = active.prompt.text.strip() if active else ""
    if not text:
        screen.notify("Type a prompt first, then broadcast it to every tab", severity="warning")
        return
    panes = screen.panes()
    sent = sum(p.send(text) for p in panes)
    active.prompt.clear()
    busy = len(panes) - sent
    if len(panes) > 1 or busy:  # to a lone tab it is a plain send: its reply says so (a toast lays out the screen)
        screen.notify(f"Broadcast to {sent} tab{'s' * (sent != 1)}" + (f"; {busy} busy, skipped" if busy else ""))


def stop(screen: ChatScreen) -> None:
    pane = screen.active_pane()
    if pane is not None:
        pane.stop()


def stop_all(screen: ChatScreen) -> None:
    stopped = sum(pane.stop() for pane in screen.panes())
    screen.notify(f"Stopped {stopped} tab{'s' * (stopped != 1)}" if stopped else "Nothing is generating")


def regenerate(screen: ChatScreen) -> None:
    pane = screen.active_pane()
    if pane is not None and not pane.regenerate():
        screen.notify("Nothing to regenerate" if not pane.session.messages
                      else "Still generating: stop it first (escape)")


# composing: files, taking a turn back, editing an earlier message in a fork

def attach(screen: ChatScreen) -> None:
    pane = screen.active_pane()
    if pane is None:
        return

    def chosen(files: list[Attachment] | None) -> None:
        if files is not None:
            pane.session.draft.set_attachments(files)
            pane.focus_input()

    screen.app.push_screen(AttachDialog(pane.session.draft.attachments), chosen)


def edit_last(screen: ChatScreen) -> None:
    pane = screen.active_pane()
    if pane is None:
        return
    if pane.generating:
        screen.notify("Still generating: stop it first (escape)", severity="warning")
    elif not pane.take_back_last_turn():
        screen.notify("No message of yours to edit yet", severity="warning")


def edit_at(screen: ChatScreen) -> None:
    """Pick one of your messages: a fork of the chat up to just before it opens with the
    message in its input (this chat stays as it was); the fork's prompt reuses its KV blocks."""
    pane = screen.active_pane()
    if pane is None or not any(m.role == "user" for m in pane.session.messages):
        screen.notify("No message of yours to edit yet", severity="warning")
        return

    def chosen(index: int | None) -> None:
        if index is not None:
            screen.run_worker(_edit_in_fork(screen, pane, index), group="tabs")

    screen.app.push_screen(MessagePicker(pane.session.messages, roles=("user",),
                                         question="Edit which message (in a fork)?"), chosen)


async def _edit_in_fork(screen: ChatScreen, pane: ChatPane, index: int) -> None:
    chat, content = pane.session.fork_to_edit(index)
    new = await screen.open(chat)
    new.load_message(content)
    screen.notify(f"Edit message {index + 1} here and press enter; “{pane.session.chat.title}” keeps the original")


# the chat's record and settings

def rename(screen: ChatScreen) -> None:
    pane = screen.active_pane()
    if pane is None:
        return

    def renamed(title: str | None) -> None:
        if title:
            pane.session.rename(title)

    screen.app.push_screen(RenameDialog(pane.session.chat.title), renamed)


def settings(screen: ChatScreen) -> None:
    pane = screen.active_pane()
    if pane is not None:
        pane.settings.toggle()


async def clear_kv_disk_cache(screen: ChatScreen) -> None:
    try:
        screen.notify(await screen.engine.clear_kv_disk_cache())
    except LocalbatchError as e:
        screen.notify(str(e), severity="error")


def toggle_json(screen: ChatScreen) -> None:
    pane = screen.active_pane()
    if pane is not None:
        state = "on: replies are JSON" if pane.session.toggle("json_mode") else "off"
        screen.notify(f"JSON mode {state} in {pane.session.chat.title}")


def toggle_tools(screen: ChatScreen) -> None:
    pane = screen.active_pane()
    if pane is None:
        return
    on = pane.session.toggle("tools")
    manager = screen.app.tools
    if not on:
        screen.notify(f"Tools off in {pane.session.chat.title}")
    elif manager is None:
        screen.notify(f"Tools on in {pane.session.chat.title}, but none are available: {screen.app.tools_off_reason}",
                      severity="warning")
    else:
        count = len(manager.offered_tools())
        screen.notify(f"Tools on in {pane.session.chat.title}: {count} offered")


def tools_view(screen: ChatScreen) -> None:
    """The MCP servers and their tools (state in the app's `ToolManager`)."""
    screen.app.push_screen(ToolsScreen(screen.app.tools, screen.app.tools_off_reason))


def export(screen: ChatScreen) -> None:
    pane = screen.active_pane()
    if pane is None:
        return
    try:
        path = export_chat(pane.session.chat, pane.session.messages, screen.export_dir(), screen.info.model_name)
    except LocalbatchError as e:
        screen.notify(str(e), severity="error")
        return
    screen.notify(f"Exported to {path}", title="Export")


# copying

def copy_reply(screen: ChatScreen) -> None:
    """The last finished reply (a streaming one is not whole yet), as its Markdown."""
    replies = _replies(screen)
    if not replies:
        screen.notify("No reply to copy yet", severity="warning")
        return
    _copy(screen, Copyable(replies[-1].content, what="the last reply"))


def copy_code(screen: ChatScreen) -> None:
    """The last code block of the newest reply that has one."""
    block = next((b[-1] for b in (code_blocks(m.content) for m in reversed(_replies(screen))) if b), None)
    if block is None:
        screen.notify("No code block in this chat yet", severity="warning")
        return
    _copy(screen, Copyable(block.code, block.language))


def copy_pick(screen: ChatScreen) -> None:
    pane = screen.active_pane()
    if pane is None or not pane.session.messages:
        screen.notify("Nothing to copy yet", severity="warning")
        return

    def chosen(item: Copyable | None) -> None:
        if item is not None:
            _copy(screen, item)

    screen.app.push_screen(CopyPicker(pane.session.messages), chosen)


def _replies(screen: ChatScreen) -> list:
    pane = screen.active_pane()
    return [m for m in pane.session.messages if m.role == "assistant"] if pane else []


def _copy(screen: ChatScreen, item: Copyable) -> None:
    screen.notify(item.notice(copy_text(screen.app, item.text)), title="Copy")
