"""Conversations in SQLite: chats (title, system prompt, sampling settings, tab order) and their
messages. Every write commits at once. A reply being generated is committed as it grows, marked
`STREAMING`; a store opened with such rows left over (the app was killed) marks them
`INTERRUPTED`, so a crash loses at most the last second of a reply.

The schema version lives in `PRAGMA user_version`; opening an older file upgrades it in place
and a newer one is refused.

Closing a tab keeps its chat (`open` = 0): the chat list shows every chat, and `search` finds a
message in any of them through an FTS5 index kept in step with `messages` by triggers (a plain
`LIKE` scan where this SQLite has no FTS5); the index holds a message's text and its tool calls.

Tool turns (schema 5) are stored as OpenAI's chat messages have them: an assistant message may
carry `tool_calls` ([{"id", "type": "function", "function": {"name", "arguments"}}], JSON in the
file) and a "tool" message answers one call (`tool_call_id`, the tool's `name`)."""

from __future__ import annotations

import itertools
import json
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

from app.engine.types.errors import LocalbatchError
from app.ui.user_config import ChatSettings

DB_NAME = "chats.sqlite3"
STREAMING = "streaming"  # finish_reason of a reply still being generated
INTERRUPTED = "interrupted"  # ... of one the app never finished (killed, crashed)
HIT_OPEN, HIT_CLOSE = "\x02", "\x03"  # around each match in a SearchHit's snippet
ROLES = ("user", "assistant", "tool")


class StoreError(LocalbatchError):
    """The chat database cannot be opened or used."""


@dataclass
class ChatRecord:
    id: int
    title: str
    system_prompt: str
    settings: ChatSettings
    position: int
    created_at: float
    open: bool = True  # shown as a tab; a closed chat is kept, listed in the chat list


@dataclass
class MessageRecord:
    id: int
    chat_id: int
    role: str  # "user" | "assistant" | "tool"
    content: str
    finish_reason: str | None = None  # assistant only: "stop" | "length" | "abort" | "error"
    num_tokens: int = 0
    ttft_s: float | None = None
    tokens_per_s: float | None = None
    created_at: float = 0.0
    model: str | None = None  # assistant only: the model that wrote it (None: before schema 3)
    # assistant only: the calls it made, OpenAI's shape: [{"id", "type": "function", "function":
    # {"name", "arguments" (JSON text)}}]; None: none.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None  # tool only: the call this message answers
    name: str | None = None  # tool only: the tool that answered


@dataclass
class ChatSummary:
    """One row of the chat list."""

    chat: ChatRecord
    num_messages: int
    num_chars: int
    model: str | None  # of its last reply that names one
    last_active: float  # its latest message's time, else the chat's


@dataclass
class SearchHit:
    """A message that matches a search; `snippet` marks each match with HIT_OPEN / HIT_CLOSE."""

    chat_id: int
    chat_title: str
    message_id: int
    message_index: int  # within its chat, 0-based in id order (ChatPane's `messages`)
    role: str
    snippet: str


@cache
def fts5_available() -> bool:
    """Whether this SQLite was built with FTS5 (asked once, on a scratch database)."""
    try:
        sqlite3.connect(":memory:").execute("CREATE VIRTUAL TABLE temp.probe USING fts5(x)")
    except sqlite3.Error:
        return False
    return True


# An external-content index (the text lives once, in `messages`). A streaming reply is UPDATEd
# about once a second: the update trigger takes the old text out of the index before putting the
# new one in, else the index would still match words the reply no longer has.
def _fts_statements(columns: tuple[str, ...]) -> tuple[str, ...]:
    names = ", ".join(columns)
    new, old = ", ".join(f"new.{c}" for c in columns), ", ".join(f"old.{c}" for c in columns)
    return (
        f"CREATE VIRTUAL TABLE messages_fts USING fts5({names}, content='messages', content_rowid='id')",
        f"""CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN
            INSERT INTO messages_fts (rowid, {names}) VALUES (new.id, {new});
        END""",
        f"""CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN
            INSERT INTO messages_fts (messages_fts, rowid, {names}) VALUES ('delete', old.id, {old});
        END""",
        f"""CREATE TRIGGER messages_fts_update AFTER UPDATE OF {names} ON messages BEGIN
            INSERT INTO messages_fts (messages_fts, rowid, {names}) VALUES ('delete', old.id, {old});
            INSERT INTO messages_fts (rowid, {names}) VALUES (new.id, {new});
        END""",
        "INSERT INTO messages_fts (messages_fts) VALUES ('rebuild')",  # index the messages already there
    )


# What search finds: the text, an assistant's tool calls (names and arguments), a result's tool.
_FTS_COLUMNS = ("content", "tool_calls", "name")


def _create_fts(db: sqlite3.Connection, columns: tuple[str, ...] = _FTS_COLUMNS) -> None:
    """The search index, where this SQLite has FTS5; without it the migration still succeeds and
    `search` scans with LIKE (a file migrated so gets its index when opened with FTS5)."""
    if fts5_available():
        for statement in _fts_statements(columns):
            db.execute(statement)


def _drop_fts(db: sqlite3.Connection) -> None:
    for trigger in ("insert", "delete", "update"):
        db.execute(f"DROP TRIGGER IF EXISTS messages_fts_{trigger}")
    db.execute("DROP TABLE IF EXISTS messages_fts")


def _add_tool_turns(db: sqlite3.Connection) -> None:
    """Schema 5: a CHECK cannot be altered, so `messages` is rebuilt (ids kept) with the "tool"
    role and the tool columns; the search index is made again over the text and the calls."""
    _drop_fts(db)
    db.execute("""CREATE TABLE messages_new (
        id INTEGER PRIMARY KEY,
        chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
        role TEXT NOT NULL CHECK (role IN ('user', 'assistant', 'tool')),
        content TEXT NOT NULL,
        created_at REAL NOT NULL,
        finish_reason TEXT,
        num_tokens INTEGER NOT NULL DEFAULT 0,
        ttft_s REAL,
        tokens_per_s REAL,
        model TEXT,
        tool_calls TEXT,
        tool_call_id TEXT,
        name TEXT
    )""")
    kept = "id, chat_id, role, content, created_at, finish_reason, num_tokens, ttft_s, tokens_per_s, model"
    db.execute(f"INSERT INTO messages_new ({kept}) SELECT {kept} FROM messages")
    db.execute("DROP TABLE messages")
    db.execute("ALTER TABLE messages_new RENAME TO messages")
    db.execute("CREATE INDEX messages_by_chat ON messages(chat_id, id)")
    _create_fts(db)


# _MIGRATIONS[i] takes the schema from version i to i + 1. Plain statements (not executescript,
# which commits on its own) so each migration runs in one transaction; a callable runs its own
# statements on the connection (a step that depends on this SQLite's features).
_MIGRATIONS: tuple[tuple[str | Callable[[sqlite3.Connection], None], ...], ...] = (
    (
        """CREATE TABLE chats (
            id INTEGER PRIMARY KEY,
            title TEXT NOT NULL,
            system_prompt TEXT NOT NULL DEFAULT '',
            settings TEXT NOT NULL DEFAULT '{}',
            position INTEGER NOT NULL,
            created_at REAL NOT NULL
        )""",
        """CREATE TABLE messages (
            id INTEGER PRIMARY KEY,
            chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
            role TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
            content TEXT NOT NULL,
            created_at REAL NOT NULL
        )""",
        "CREATE INDEX messages_by_chat ON messages(chat_id, id)",
    ),
    (
        # Reply metadata shown under each answer; an app-wide key/value table (the active tab).
        "ALTER TABLE messages ADD COLUMN finish_reason TEXT",
        "ALTER TABLE messages ADD COLUMN num_tokens INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE messages ADD COLUMN ttft_s REAL",
        "ALTER TABLE messages ADD COLUMN tokens_per_s REAL",
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    ),
    (
        # Models can be switched inside the app: each reply records which one wrote it.
        "ALTER TABLE messages ADD COLUMN model TEXT",
    ),
    (
        # Closing a tab keeps the chat; every message is searchable.
        "ALTER TABLE chats ADD COLUMN open INTEGER NOT NULL DEFAULT 1",
        lambda db: _create_fts(db, ("content",)),
    ),
    (
        # Tool turns: an assistant's tool calls, and "tool" messages with their results.
        _add_tool_turns,
    ),
)
SCHEMA_VERSION = len(_MIGRATIONS)

_MESSAGE_COLUMNS = ("id, chat_id, role, content, finish_reason, num_tokens, ttft_s, tokens_per_s, created_at, model,"
                    " tool_calls, tool_call_id, name")
_CHAT_COLUMNS = "id, title, system_prompt, settings, position, created_at, open"
# What a new message row is written with (`_row`), in this order.
_INSERTED_COLUMNS = ("chat_id, role, content, created_at, finish_reason, num_tokens, ttft_s, tokens_per_s, model,"
                     " tool_calls, tool_call_id, name")
_INSERTED_COUNT = len(_INSERTED_COLUMNS.split(","))


def _json_or_null(value: list[dict[str, Any]] | None) -> str | None:
    return json.dumps(value) if value else None


def _row(chat_id: int, role: str, content: str, created_at: float, m: MessageRecord) -> tuple:
    """`m`'s values for _INSERTED_COLUMNS, in `chat_id` (a fork copies messages into another chat)."""
    return (chat_id, role, content, created_at, m.finish_reason, m.num_tokens, m.ttft_s, m.tokens_per_s, m.model,
            _json_or_null(m.tool_calls), m.tool_call_id, m.name)


def _message(row: tuple) -> MessageRecord:
    """A row of _MESSAGE_COLUMNS; tool calls that do not parse (a file edited by hand) read as none."""
    *head, tool_calls, tool_call_id, name = row
    try:
        calls = json.loads(tool_calls) if tool_calls else None
    except json.JSONDecodeError:
        calls = None
    return MessageRecord(*head, tool_calls=calls if isinstance(calls, list) else None, tool_call_id=tool_call_id,
                         name=name)


def _version(db: sqlite3.Connection) -> int:
    return db.execute("PRAGMA user_version").fetchone()[0]


def _migrate(db: sqlite3.Connection, path: Path) -> None:
    version = _version(db)
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"chat database {path} has schema version {version}, newer than this localbatch "
            f"understands ({SCHEMA_VERSION}); upgrade localbatch or pass another --data-dir"
        )
    for target in range(version + 1, SCHEMA_VERSION + 1):
        with _Transaction(db):
            for statement in _MIGRATIONS[target - 1]:
                statement(db) if callable(statement) else db.execute(statement)
            db.execute(f"PRAGMA user_version = {target}")


def _has_fts(db: sqlite3.Connection) -> bool:
    """Whether `search` can use the FTS5 index (made here for a file migrated without one)."""
    if not fts5_available():
        return False
    if db.execute("SELECT 1 FROM sqlite_master WHERE name = 'messages_fts'").fetchone() is None:
        with _Transaction(db):
            _create_fts(db)
    return True


class ChatStore:
    """One SQLite file; used from the UI thread only."""

    def __init__(self, path: Path, defaults: ChatSettings | None = None) -> None:
        self.path = Path(path)
        self.defaults = defaults or ChatSettings()
        # A write that fails (read-only file, full disk) is said once through this, and the app
        # goes on with what it holds in memory (records get negative ids).
        self.on_write_error: Callable[[str], None] | None = None
        self.write_error: str | None = None
        self._memory_ids = itertools.count(-1, -1)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # isolation_level=None: autocommit, each statement is durable when it returns.
            self._db = sqlite3.connect(self.path, isolation_level=None)
            self._db.execute("PRAGMA foreign_keys = ON")
            _migrate(self._db, self.path)
            self._fts = _has_fts(self._db)
        except sqlite3.Error as e:
            raise StoreError(f"cannot open chat database {self.path}: {e}") from None

        # In WAL mode NORMAL survives an app crash (only an OS crash may lose the last commits)
        # without an fsync per message. A file that cannot be written fails these: said later.
        self._write("PRAGMA journal_mode = WAL")
        self._write("PRAGMA synchronous = NORMAL")
        self._write("UPDATE messages SET finish_reason = ? WHERE finish_reason = ?", (INTERRUPTED, STREAMING))

    @classmethod
    def in_dir(cls, data_dir: Path, defaults: ChatSettings | None = None) -> ChatStore:
        return cls(Path(data_dir) / DB_NAME, defaults)

    @property
    def version(self) -> int:
        return _version(self._db)

    def _write(self, sql: str, params: tuple = ()) -> int:
        """Run one write; its row id, or a new negative id where the file cannot be written."""
        try:
            return self._db.execute(sql, params).lastrowid
        except sqlite3.Error as e:
            if self.write_error is None:
                self.write_error = str(e)
                if self.on_write_error is not None:
                    self.on_write_error(f"cannot save chats to {self.path} ({e}): they are kept in memory until the "
                                        "app exits")
            return next(self._memory_ids)

    def close(self) -> None:
        self._db.close()

    # chats

    def create_chat(self, title: str, system_prompt: str = "", settings: ChatSettings | None = None) -> ChatRecord:
        settings = settings or self.defaults
        position = self._db.execute("SELECT COALESCE(MAX(position), -1) + 1 FROM chats").fetchone()[0]
        now = time.time()
        chat_id = self._write(
            "INSERT INTO chats (title, system_prompt, settings, position, created_at, open) VALUES (?, ?, ?, ?, ?, 1)",
            (title, system_prompt, json.dumps(settings.to_dict()), position, now),
        )
        return ChatRecord(chat_id, title, system_prompt, settings, position, now)

    def chats(self) -> list[ChatRecord]:
        """Every chat, open or closed, in tab order."""
        rows = self._db.execute(f"SELECT {_CHAT_COLUMNS} FROM chats ORDER BY position, id").fetchall()
        return [self._chat(row) for row in rows]

    def open_chats(self) -> list[ChatRecord]:
        """The chats shown as tabs, in tab order."""
        rows = self._db.execute(f"SELECT {_CHAT_COLUMNS} FROM chats WHERE open = 1 ORDER BY position, id").fetchall()
        return [self._chat(row) for row in rows]

    def set_open(self, chat_id: int, open: bool) -> None:
        """Show a chat as a tab or close it (kept). A chat reopened goes after the other tabs, where
        the screen puts it, so a restart shows the tabs in the same order."""
        self._write(
            "UPDATE chats SET position = CASE WHEN ?1 AND open = 0 THEN (SELECT MAX(position) + 1 FROM chats)"
            " ELSE position END, open = ?1 WHERE id = ?2", (int(open), chat_id))

    def chat(self, chat_id: int) -> ChatRecord:
        row = self._db.execute(f"SELECT {_CHAT_COLUMNS} FROM chats WHERE id = ?", (chat_id,)).fetchone()
        if row is None:
            raise StoreError(f"chat {chat_id} does not exist")
        return self._chat(row)

    def _chat(self, row: tuple) -> ChatRecord:
        chat_id, title, system_prompt, settings, position, created_at, is_open = row
        try:
            data = json.loads(settings)
        except json.JSONDecodeError:
            data = {}
        settings = ChatSettings.from_dict(data, self.defaults)
        return ChatRecord(chat_id, title, system_prompt, settings, position, created_at, bool(is_open))

    def chat_summaries(self) -> list[ChatSummary]:
        """Every chat with its size, last model and last activity, the most recently active first
        (one query: the chat list is built from it when it opens)."""
        rows = self._db.execute(
            f"SELECT {', '.join('c.' + col for col in _CHAT_COLUMNS.split(', '))},"
            " COUNT(m.id), COALESCE(SUM(LENGTH(m.content)), 0),"
            " (SELECT r.model FROM messages r WHERE r.chat_id = c.id AND r.model IS NOT NULL ORDER BY r.id DESC"
            "  LIMIT 1),"
            " COALESCE(MAX(m.created_at), c.created_at) AS last_active"
            " FROM chats c LEFT JOIN messages m ON m.chat_id = c.id"
            " GROUP BY c.id ORDER BY last_active DESC, c.id DESC"
        ).fetchall()
        return [ChatSummary(self._chat(row[:7]), *row[7:]) for row in rows]

    def fork_chat(self, chat: ChatRecord, messages: list[MessageRecord], title: str) -> ChatRecord:
        """A new chat with `chat`'s system prompt and settings and copies of `messages` (one
        transaction: a crash leaves no half-copied fork)."""
        if self.write_error is not None:
            return self.create_chat(title, chat.system_prompt, chat.settings)
        with _Transaction(self._db):
            fork = self.create_chat(title, chat.system_prompt, chat.settings)
            self._db.executemany(
                f"INSERT INTO messages ({_INSERTED_COLUMNS}) VALUES ({', '.join('?' * _INSERTED_COUNT)})",
                [_row(fork.id, m.role, m.content, m.created_at, m) for m in messages],
            )
        return fork

    def update_chat(self, chat: ChatRecord) -> None:
        self._write(
            "UPDATE chats SET title = ?, system_prompt = ?, settings = ? WHERE id = ?",
            (chat.title, chat.system_prompt, json.dumps(chat.settings.to_dict()), chat.id),
        )

    def delete_chat(self, chat_id: int) -> None:
        self._write("DELETE FROM chats WHERE id = ?", (chat_id,))

    # messages

    def add_message(
        self,
        chat_id: int,
        role: str,
        content: str,
        *,
        finish_reason: str | None = None,
        num_tokens: int = 0,
        ttft_s: float | None = None,
        tokens_per_s: float | None = None,
        model: str | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
        tool_call_id: str | None = None,
        name: str | None = None,
    ) -> MessageRecord:
        """A message; `tool_calls` (an assistant's) and `tool_call_id` / `name` (a "tool" result's)
        as `MessageRecord` has them."""
        if role not in ROLES:
            raise StoreError(f"unknown message role {role!r}; one of {', '.join(ROLES)}")
        message = MessageRecord(0, chat_id, role, content, finish_reason, num_tokens, ttft_s, tokens_per_s, time.time(),
                                model, tool_calls, tool_call_id, name)
        message.id = self._write(
            f"INSERT INTO messages ({_INSERTED_COLUMNS}) VALUES ({', '.join('?' * _INSERTED_COUNT)})",
            _row(chat_id, role, content, message.created_at, message),
        )
        return message

    def update_reply(self, message: MessageRecord, content: str, *, finish_reason: str | None, num_tokens: int,
                     ttft_s: float | None, tokens_per_s: float | None,
                     tool_calls: list[dict[str, Any]] | None = None) -> MessageRecord:
        """A reply committed while it grows: its text so far, or its final text and metadata (and
        the tool calls it ended with, if any)."""
        self._write(
            "UPDATE messages SET content = ?, finish_reason = ?, num_tokens = ?, ttft_s = ?, tokens_per_s = ?,"
            " tool_calls = ? WHERE id = ?",
            (content, finish_reason, num_tokens, ttft_s, tokens_per_s, _json_or_null(tool_calls), message.id))
        return replace(message, content=content, finish_reason=finish_reason, num_tokens=num_tokens, ttft_s=ttft_s,
                       tokens_per_s=tokens_per_s, tool_calls=tool_calls)

    def messages(self, chat_id: int) -> list[MessageRecord]:
        rows = self._db.execute(
            f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE chat_id = ? ORDER BY id", (chat_id,)
        ).fetchall()
        return [_message(row) for row in rows]

    def recent_prompts(self, limit: int = 200) -> list[str]:
        """The user messages of every chat, newest first (the input's up-arrow history)."""
        rows = self._db.execute("SELECT content FROM messages WHERE role = 'user' ORDER BY id DESC LIMIT ?",
                                (limit,)).fetchall()
        return [row[0] for row in rows]

    def count_messages(self, chat_id: int) -> int:
        return self._db.execute("SELECT COUNT(*) FROM messages WHERE chat_id = ?", (chat_id,)).fetchone()[0]

    def delete_message(self, message_id: int) -> None:
        self._write("DELETE FROM messages WHERE id = ?", (message_id,))

    # search

    def search(self, query: str, limit: int = 50) -> list[SearchHit]:
        """Messages of every chat that hold each word of `query` (the last one as a prefix, for
        search as you type), best match first, then newest. Any text is taken literally: no
        FTS syntax error can come of what the user types."""
        terms = query.split()
        if not terms:
            return []
        return (_search_fts if self._fts else _search_like)(self._db, terms, limit)

    # app state

    def get_meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def set_meta(self, key: str, value: str) -> None:
        self._write("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                    (key, value))


_HIT_COLUMNS = ("m.chat_id, c.title, m.id, (SELECT COUNT(*) FROM messages p WHERE p.chat_id = m.chat_id AND p.id < m.id),"
                " m.role")


def _search_fts(db: sqlite3.Connection, terms: list[str], limit: int) -> list[SearchHit]:
    match = " ".join('"' + term.replace('"', '""') + '"' for term in terms) + "*"
    rows = db.execute(
        f"SELECT {_HIT_COLUMNS}, snippet(messages_fts, -1, ?, ?, '…', 16)"
        " FROM messages_fts JOIN messages m ON m.id = messages_fts.rowid JOIN chats c ON c.id = m.chat_id"
        " WHERE messages_fts MATCH ? ORDER BY bm25(messages_fts), m.id DESC LIMIT ?",
        (HIT_OPEN, HIT_CLOSE, match, limit),
    ).fetchall()
    return [SearchHit(*row) for row in rows]


def _search_like(db: sqlite3.Connection, terms: list[str], limit: int) -> list[SearchHit]:
    """Without FTS5: a scan with one LIKE per word (case-insensitive for ASCII) over a message's
    text and tool calls, newest first."""
    patterns = ["%" + term.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%" for term in terms]
    searched = "(m.content || CHAR(10) || COALESCE(m.tool_calls, '') || CHAR(10) || COALESCE(m.name, ''))"
    where = " AND ".join(f"{searched} LIKE ? ESCAPE '\\'" for _ in patterns)
    rows = db.execute(
        f"SELECT {_HIT_COLUMNS}, m.content, COALESCE(m.tool_calls, m.name) FROM messages m"
        " JOIN chats c ON c.id = m.chat_id"
        f" WHERE {where} ORDER BY m.id DESC LIMIT ?", (*patterns, limit),
    ).fetchall()
    return [SearchHit(*row[:5], _snippet(_matched_text(row[5], row[6], terms), terms)) for row in rows]


def _matched_text(content: str, tools: str | None, terms: list[str]) -> str:
    """The text a snippet is cut from: the message's, unless only its tool calls (or tool) match."""
    lower = content.lower()
    return content if tools is None or any(t.lower() in lower for t in terms) else tools


def _snippet(text: str, terms: list[str], width: int = 80) -> str:
    """Up to `width` characters of `text` around the first match of `terms`, each match marked
    as FTS5's snippet() marks it."""
    lower = text.lower()
    first = min((i for i in (lower.find(t.lower()) for t in terms) if i >= 0), default=0)
    start = max(first - width // 3, 0)
    end = min(start + width, len(text))
    window = text[start:end]
    marked, low, pos = [], window.lower(), 0
    while True:
        found = [(i, t) for t in terms if (i := low.find(t.lower(), pos)) >= 0]
        if not found:
            break
        i, term = min(found)
        marked += [window[pos:i], HIT_OPEN, window[i:i + len(term)], HIT_CLOSE]
        pos = i + len(term)
    marked.append(window[pos:])
    return ("…" if start else "") + "".join(marked) + ("…" if end < len(text) else "")


class _Transaction:
    """BEGIN/COMMIT around a migration so a failed one leaves the file at the old version."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN")

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._db.execute("COMMIT" if exc_type is None else "ROLLBACK")
