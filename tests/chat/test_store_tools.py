"""Tool turns in the chat store (schema 5): a schema-4 file opens and migrates with its messages and
search index, tool calls and results are stored, copied by a fork, found by search and exported."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from app.ui import store as store_module
from app.ui.export import chat_to_markdown
from app.ui.store import _MIGRATIONS, HIT_CLOSE, HIT_OPEN, SCHEMA_VERSION, ChatStore, StoreError

CALL = {"id": "call_7", "type": "function", "function": {"name": "search_code", "arguments": '{"pattern": "zebra"}'}}


def schema_4_file(path: Path) -> None:
    """A chat database as the schema-4 app wrote it: a chat, a question, a reply."""
    db = sqlite3.connect(path, isolation_level=None)
    for migration in _MIGRATIONS[:4]:
        for statement in migration:
            statement(db) if callable(statement) else db.execute(statement)
    db.execute("INSERT INTO chats (id, title, position, created_at) VALUES (1, 'old chat', 0, 0)")
    db.execute("INSERT INTO messages (chat_id, role, content, created_at) VALUES (1, 'user', 'ancient wisdom', 1)")
    db.execute("INSERT INTO messages (chat_id, role, content, created_at, finish_reason, num_tokens, model)"
               " VALUES (1, 'assistant', 'a reply', 2, 'stop', 3, 'm')")
    db.execute("PRAGMA user_version = 4")
    db.close()


def test_a_schema_4_file_migrates_keeps_its_messages_and_takes_tool_turns(tmp_path: Path) -> None:
    path = tmp_path / "chats.sqlite3"
    schema_4_file(path)
    store = ChatStore(path)
    assert store.version == SCHEMA_VERSION == 5
    old = store.messages(1)
    assert [(m.id, m.role, m.content, m.finish_reason, m.num_tokens, m.model, m.tool_calls) for m in old] == [
        (1, "user", "ancient wisdom", None, 0, None, None), (2, "assistant", "a reply", "stop", 3, "m", None)]
    [hit] = store.search("wisdom")
    assert hit.snippet == f"ancient {HIT_OPEN}wisdom{HIT_CLOSE}" and hit.message_index == 0
    call = store.add_message(1, "assistant", "", tool_calls=[CALL], model="m")
    result = store.add_message(1, "tool", "zoo.py:3: zebra", tool_call_id="call_7", name="search_code")
    store.close()
    store = ChatStore(path)  # reopened: read back as written
    assert store.messages(1)[2:] == [call, result]
    assert store.messages(1)[2].tool_calls == [CALL] and store.messages(1)[3].tool_call_id == "call_7"
    assert sorted(h.message_index for h in store.search("search_code")) == [2, 3]  # the call and its result
    assert sorted(h.message_index for h in store.search("zebra")) == [2, 3]
    assert store._db.execute("INSERT INTO messages_fts (messages_fts) VALUES ('integrity-check')")
    with pytest.raises(StoreError, match="unknown message role 'system'"):
        store.add_message(1, "system", "no")


def test_a_reply_ending_in_calls_and_a_fork_keep_them(tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "chats.sqlite3")
    chat = store.create_chat("tools")
    store.add_message(chat.id, "user", "find zebras")
    reply = store.add_message(chat.id, "assistant", "looking", finish_reason="streaming", model="m")
    reply = store.update_reply(reply, "looking", finish_reason="stop", num_tokens=2, ttft_s=None, tokens_per_s=None,
                               tool_calls=[CALL])
    store.add_message(chat.id, "tool", "none found", tool_call_id="call_7", name="search_code")
    assert store.messages(chat.id)[1] == reply and reply.tool_calls == [CALL]
    fork = store.fork_chat(chat, store.messages(chat.id), "tools (fork)")
    copied = store.messages(fork.id)
    assert [(m.role, m.content, m.tool_calls, m.tool_call_id, m.name) for m in copied] == [
        (m.role, m.content, m.tool_calls, m.tool_call_id, m.name) for m in store.messages(chat.id)]
    markdown = chat_to_markdown(chat, store.messages(chat.id), "m")
    assert "## Tool `search_code`\n\nnone found" in markdown
    assert '- calls `search_code` with `{"pattern": "zebra"}`' in markdown


def test_without_fts5_tool_calls_are_found_by_a_scan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_module, "fts5_available", lambda: False)
    path = tmp_path / "chats.sqlite3"
    schema_4_file(path)
    store = ChatStore(path)
    assert store.version == SCHEMA_VERSION
    store.add_message(1, "assistant", "", tool_calls=[CALL])
    [hit] = store.search("search_code")
    assert hit.message_index == 2 and f"{HIT_OPEN}search_code{HIT_CLOSE}" in hit.snippet
    assert [h.message_index for h in store.search("wisdom")] == [0]
