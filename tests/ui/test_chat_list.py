"""The chat list: closing a tab keeps its chat, the list reopens or deletes it, and a full-text
search over every chat opens the chat at the hit message. Then the store under it: schema 4's
migration, the FTS5 index kept in step with streamed replies, and the LIKE fallback."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from textual.widgets import Input, OptionList

from app.ui import store as store_module
from app.ui import message_list as chat_module
from app.ui.message_list import HISTORY_PAGE
from app.ui.chat_list import ChatListScreen
from app.ui.dialogs import ConfirmDialog
from app.ui.store import _MIGRATIONS, HIT_CLOSE, HIT_OPEN, SCHEMA_VERSION, ChatStore
from app.ui.widgets import MessageView
from tests.ui.test_tui import SIZE, chat_screen, idle, make_app, type_and_send, until


async def open_list(pilot: Any) -> ChatListScreen:
    await pilot.press("ctrl+l")
    await until(pilot, lambda: isinstance(pilot.app.screen, ChatListScreen))
    await pilot.pause()
    return pilot.app.screen


def rows(screen: ChatListScreen) -> list[str]:
    results = screen.query_one(OptionList)
    return [str(results.get_option_at_index(i).prompt) for i in range(results.option_count)]


def notices(app: Any) -> list[str]:
    return [str(n.message) for n in app._notifications]


# --- the app ------------------------------------------------------------------------------------


async def test_closing_a_tab_keeps_the_chat_and_the_list_reopens_it(tmp_path: Path) -> None:
    app, _ = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        await type_and_send(pilot, "keep this chat")
        await idle(pilot, screen)
        kept = screen.active_pane().session.chat
        await pilot.press("ctrl+w")  # has messages: closes without asking, the chat stays
        await until(pilot, lambda: kept.id not in [p.session.chat.id for p in screen.panes()])
        assert app.screen is screen
        assert [p.session.chat.title for p in screen.panes()] == ["Chat 1"]  # the last tab gave way to a new one
        assert not app.store.chat(kept.id).open
        assert app.store.count_messages(kept.id) == 2
        assert "Closed “keep this chat”: ctrl+l lists it" in notices(app)

        chats = await open_list(pilot)
        assert chats.query_one("#chat-count").render().plain == "2 chats"
        listed = rows(chats)
        assert any(row.startswith("  keep this chat") and "2 messages" in row for row in listed)
        assert any(row.startswith("● Chat 1") for row in listed)  # open as a tab
        results = chats.query_one(OptionList)
        assert chats.focused is results
        results.highlighted = results.get_option_index(f"chat-{kept.id}")
        await pilot.press("enter")
        await until(pilot, lambda: screen.active_pane() is not None and screen.active_pane().session.chat.id == kept.id)
        pane = screen.active_pane()
        assert [m.content for m in pane.session.messages] == ["keep this chat", "Reply to: keep this chat"]
        assert app.store.chat(kept.id).open
        await until(pilot, lambda: len(pane.query(MessageView)) == 2)

        await pilot.press("ctrl+w")  # closed again, then the app restarts
        await until(pilot, lambda: len(screen.panes()) == 1)
        await pilot.press("ctrl+q")

    app2, _ = make_app(tmp_path)
    async with app2.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        assert [p.session.chat.id for p in screen.panes()] != [kept.id]
        assert kept.id not in [p.session.chat.id for p in screen.panes()]
        assert kept.id in [c.id for c in app2.store.chats()]


async def test_search_opens_the_chat_at_the_hit_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hit is the first of 30 messages in a closed chat: the pages down to it are mounted and
    it is scrolled into view, marked."""
    monkeypatch.setattr(chat_module, "HIT_MARK_S", 60.0)  # a loaded machine may look after the mark is gone
    store = ChatStore.in_dir(tmp_path / "data")
    store.create_chat("Chat 1")
    old = store.create_chat("Long ago")
    for i in range(30):
        role = "user" if i % 2 == 0 else "assistant"
        store.add_message(old.id, role, "the zebra crossing" if i == 0 else f"message number {i}\n\nmore text " * 3)
    store.set_open(old.id, False)
    store.close()

    app, _ = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        assert old.id not in [p.session.chat.id for p in screen.panes()]
        chats = await open_list(pilot)
        await pilot.press(*"zebr")  # typed in the list: goes to the search box (a prefix)
        assert chats.query_one(Input).value == "zebr"
        await until(pilot, lambda: chats.query_one("#chat-count").render().plain == "1 match in 1 chat")
        assert rows(chats) == ["Long ago · You\n    the zebra crossing"]
        hit = chats.query_one(OptionList).get_option_at_index(0).prompt
        assert any(span.style == "bold reverse" and hit.plain[span.start:span.end] == "zebra" for span in hit.spans)
        await pilot.press("enter")
        await until(pilot, lambda: app.screen is screen and screen.active_pane().session.chat.id == old.id)
        pane = screen.active_pane()
        scroll = pane.query_one(".messages")

        def shown() -> bool:
            views = list(scroll.query_children(MessageView))
            if len(views) < 30 or not views[0].has_class("hit"):
                return False
            top = views[0].virtual_region.y
            return scroll.scroll_y <= top < scroll.scroll_y + scroll.scrollable_content_region.height

        def why() -> str:
            views = list(scroll.query_children(MessageView))
            return (f"scroll_y={scroll.scroll_y} n={len(views)} hit={[v.has_class('hit') for v in views[:3]]} "
                    f"top={[v.virtual_region.y for v in views[:3]]} h={scroll.scrollable_content_region.height}")

        await until(pilot, shown, message=why)
        assert len(pane.session.messages) == 30 > HISTORY_PAGE


async def test_search_chats_command_focuses_the_search_box(tmp_path: Path) -> None:
    app, _ = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        commands = {c.title: c for c in app.get_system_commands(screen)}
        for title in ("Search chats", "Chats", "Close tab", "Delete chat"):
            assert title in commands
        commands["Search chats"].callback()
        await until(pilot, lambda: isinstance(app.screen, ChatListScreen))
        await pilot.pause()
        assert isinstance(app.focused, Input)
        await pilot.press("down")
        assert isinstance(app.focused, OptionList)
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is screen)


async def test_deleting_from_the_list_asks_first_and_closes_the_tab(tmp_path: Path) -> None:
    app, _ = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        await type_and_send(pilot, "doomed chat")
        await idle(pilot, screen)
        doomed = screen.active_pane().session.chat
        await pilot.press("ctrl+n")
        await until(pilot, lambda: len(screen.panes()) == 2)
        chats = await open_list(pilot)
        results = chats.query_one(OptionList)
        results.highlighted = results.get_option_index(f"chat-{doomed.id}")
        await pilot.press("delete")
        await until(pilot, lambda: isinstance(app.screen, ConfirmDialog))
        await pilot.press("escape")  # kept
        await until(pilot, lambda: app.screen is chats)
        assert app.store.count_messages(doomed.id) == 2
        await pilot.press("delete")
        await until(pilot, lambda: isinstance(app.screen, ConfirmDialog))
        await pilot.click("#confirm")
        await until(pilot, lambda: app.screen is chats and rows(chats) and len(rows(chats)) == 1)
        assert doomed.id not in [c.id for c in app.store.chats()]
        assert doomed.id not in [p.session.chat.id for p in screen.panes()]
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is screen)
        assert len(screen.panes()) == 1


async def test_delete_chat_asks_first(tmp_path: Path) -> None:
    app, _ = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        await type_and_send(pilot, "delete me")
        await idle(pilot, screen)
        chat = screen.active_pane().session.chat
        await pilot.press("ctrl+delete")
        await until(pilot, lambda: isinstance(app.screen, ConfirmDialog))
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is screen)
        assert app.store.count_messages(chat.id) == 2
        await pilot.press("ctrl+delete")
        await until(pilot, lambda: isinstance(app.screen, ConfirmDialog))
        await pilot.click("#confirm")
        await until(pilot, lambda: [p.session.chat.title for p in screen.panes()] == ["Chat 1"])  # a new, empty chat
        assert [c.title for c in app.store.chats()] == ["Chat 1"]
        assert app.store.count_messages(chat.id) == 0


# --- the store ----------------------------------------------------------------------------------


def test_a_version_3_file_migrates_and_its_messages_are_searchable(tmp_path: Path) -> None:
    path = tmp_path / "chats.sqlite3"
    db = sqlite3.connect(path, isolation_level=None)
    for migration in _MIGRATIONS[:3]:
        for statement in migration:
            db.execute(statement)
    db.execute("INSERT INTO chats (id, title, position, created_at) VALUES (1, 'old', 0, 0)")
    db.execute("INSERT INTO messages (chat_id, role, content, created_at) VALUES (1, 'user', 'ancient wisdom', 0)")
    db.execute("PRAGMA user_version = 3")
    db.close()
    store = ChatStore(path)
    assert store.version == SCHEMA_VERSION == 5
    assert store.chat(1).open and [c.id for c in store.open_chats()] == [1]
    [hit] = store.search("wisdom")
    assert (hit.chat_id, hit.chat_title, hit.message_index, hit.role) == (1, "old", 0, "user")
    assert hit.snippet == f"ancient {HIT_OPEN}wisdom{HIT_CLOSE}"


def test_search_takes_any_text_literally(tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "chats.sqlite3")
    chat = store.create_chat("code")
    store.add_message(chat.id, "user", 'call foo(bar) AND "quote" * star')
    for query in ("foo(", '"', "AND", "*", "a OR", "NEAR(", "-x", "col:x", "^", "'", "foo) (", '"foo', "\\"):
        store.search(query)  # never an FTS syntax error
    assert [h.message_index for h in store.search("foo(")] == [0]
    assert store.search("AND") and store.search('"quote"')
    assert store.search("") == [] and store.search("   ") == []
    assert store.search("ba")  # the last word is a prefix
    assert store.search("nothing") == []


def test_a_streamed_reply_is_found_by_its_final_text(tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "chats.sqlite3")
    chat = store.create_chat("streamed")
    store.add_message(chat.id, "user", "question")
    reply = store.add_message(chat.id, "assistant", "draftword so", finish_reason="streaming", model="m")
    reply = store.update_reply(reply, "draftword so far", finish_reason="streaming", num_tokens=3, ttft_s=None,
                               tokens_per_s=None)
    store.update_reply(reply, "finalword answer", finish_reason="stop", num_tokens=2, ttft_s=None, tokens_per_s=None)
    assert store.search("draftword") == []
    [hit] = store.search("finalword")
    assert (hit.message_id, hit.message_index, hit.role) == (reply.id, 1, "assistant")
    store.delete_chat(chat.id)  # the cascade takes its messages out of the index too
    assert store.search("finalword") == [] and store.search("question") == []
    assert store._db.execute("INSERT INTO messages_fts (messages_fts) VALUES ('integrity-check')")


def test_without_fts5_search_scans_with_like(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_module, "fts5_available", lambda: False)
    path = tmp_path / "chats.sqlite3"
    store = ChatStore(path)
    assert store.version == SCHEMA_VERSION
    assert store._db.execute("SELECT 1 FROM sqlite_master WHERE name = 'messages_fts'").fetchone() is None
    chat = store.create_chat("plain")
    store.add_message(chat.id, "user", "100% of the_zebras")
    reply = store.add_message(chat.id, "assistant", "old text", model="m")
    store.update_reply(reply, "new Zebra text", finish_reason="stop", num_tokens=3, ttft_s=None, tokens_per_s=None)
    assert [h.message_index for h in store.search("zebra")] == [1, 0]  # newest first
    assert store.search("zebra")[0].snippet == f"new {HIT_OPEN}Zebra{HIT_CLOSE} text"
    assert [h.message_index for h in store.search("100%")] == [0]
    assert store.search("0%_") == [] and store.search("old") == []
    assert store.search('foo( " AND *') == []
    store.close()
    monkeypatch.undo()  # opened where FTS5 exists, the file gets its index
    store = ChatStore(path)
    assert [h.message_index for h in store.search("zebr")] == [1, 0]


def test_chat_summaries_count_size_model_and_last_activity(tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "chats.sqlite3")
    first = store.create_chat("first")
    store.add_message(first.id, "user", "hello")
    store.add_message(first.id, "assistant", "hi there", model="m1")
    empty = store.create_chat("empty")
    store.set_open(first.id, False)
    summaries = store.chat_summaries()
    assert [s.chat.id for s in summaries] == [empty.id, first.id]  # newest activity first
    s = summaries[1]
    assert (s.num_messages, s.num_chars, s.model, s.chat.open) == (2, 13, "m1", False)
    assert summaries[0].num_messages == 0 and summaries[0].last_active == empty.created_at
    store.set_open(first.id, True)  # reopened: after the other tabs
    assert [c.id for c in store.open_chats()] == [empty.id, first.id]
