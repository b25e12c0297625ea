"""Conversations in SQLite: chats (title, system prompt, sampling settings, tab order) and their
messages. Every write commits at once. A reply being generated is committed as it grows, marked
`STREAMING`; a store opened with such rows left over (the app was killed) marks them
`INTERRUPTED`, so a crash loses at most the last second of a reply.

The schema version lives in `PRAGMA user_version`; opening an older file upgrades it in place
and a newer one is refused."""

from __future__ import annotations

import itertools
import json
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from app.engine.types.errors import LocalbatchError
from app.ui.user_config import ChatSettings

DB_NAME = "chats.sqlite3"
STREAMING = "streaming"  # finish_reason of a reply still being generated
INTERRUPTED = "interrupted"  # ... of one the app never finished (killed, crashed)


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


@dataclass
class MessageRecord:
    id: int
    chat_id: int
    role: str  # "user" | "assistant"
    content: str
    finish_reason: str | None = None  # assistant only: "stop" | "length" | "abort" | "error"
    num_tokens: int = 0
    ttft_s: float | None = None
    tokens_per_s: float | None = None
    created_at: float = 0.0
    model: str | None = None  # assistant only: the model that wrote it (None: before schema 3)


# _MIGRATIONS[i] takes the schema from version i to i + 1. Plain statements (not executescript,
# which commits on its own) so each migration runs in one transaction.
_MIGRATIONS: tuple[tuple[str, ...], ...] = (
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
)
SCHEMA_VERSION = len(_MIGRATIONS)

_MESSAGE_COLUMNS = "id, chat_id, role, content, finish_reason, num_tokens, ttft_s, tokens_per_s, created_at, model"


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
            self._migrate()
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
        return self._db.execute("PRAGMA user_version").fetchone()[0]

    def _migrate(self) -> None:
        version = self.version
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"chat database {self.path} has schema version {version}, newer than this localbatch "
                f"understands ({SCHEMA_VERSION}); upgrade localbatch or pass another --data-dir"
            )
        for target in range(version + 1, SCHEMA_VERSION + 1):
            with self._transaction():
                for statement in _MIGRATIONS[target - 1]:
                    self._db.execute(statement)
                self._db.execute(f"PRAGMA user_version = {target}")

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

    def _transaction(self) -> _Transaction:
        return _Transaction(self._db)

    def close(self) -> None:
        self._db.close()

    # chats

    def create_chat(self, title: str, system_prompt: str = "", settings: ChatSettings | None = None) -> ChatRecord:
        settings = settings or self.defaults
        position = self._db.execute("SELECT COALESCE(MAX(position), -1) + 1 FROM chats").fetchone()[0]
        now = time.time()
        chat_id = self._write(
            "INSERT INTO chats (title, system_prompt, settings, position, created_at) VALUES (?, ?, ?, ?, ?)",
            (title, system_prompt, json.dumps(settings.to_dict()), position, now),
        )
        return ChatRecord(chat_id, title, system_prompt, settings, position, now)

    def chats(self) -> list[ChatRecord]:
        rows = self._db.execute(
            "SELECT id, title, system_prompt, settings, position, created_at FROM chats ORDER BY position, id"
        ).fetchall()
        return [self._chat(row) for row in rows]

    def chat(self, chat_id: int) -> ChatRecord:
        row = self._db.execute(
            "SELECT id, title, system_prompt, settings, position, created_at FROM chats WHERE id = ?", (chat_id,)
        ).fetchone()
        if row is None:
            raise StoreError(f"chat {chat_id} does not exist")
        return self._chat(row)

    def _chat(self, row: tuple) -> ChatRecord:
        chat_id, title, system_prompt, settings, position, created_at = row
        try:
            data = json.loads(settings)
        except json.JSONDecodeError:
            data = {}
        return ChatRecord(chat_id, title, system_prompt, ChatSettings.from_dict(data, self.defaults), position, created_at)

    def fork_chat(self, chat: ChatRecord, messages: list[MessageRecord], title: str) -> ChatRecord:
        """A new chat with `chat`'s system prompt and settings and copies of `messages` (one
        transaction: a crash leaves no half-copied fork)."""
        if self.write_error is not None:
            return self.create_chat(title, chat.system_prompt, chat.settings)
        with self._transaction():
            fork = self.create_chat(title, chat.system_prompt, chat.settings)
            self._db.executemany(
                "INSERT INTO messages (chat_id, role, content, finish_reason, num_tokens, ttft_s, tokens_per_s,"
                " created_at, model) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [(fork.id, m.role, m.content, m.finish_reason, m.num_tokens, m.ttft_s, m.tokens_per_s, m.created_at,
                  m.model) for m in messages],
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
    ) -> MessageRecord:
        now = time.time()
        message_id = self._write(
            "INSERT INTO messages (chat_id, role, content, finish_reason, num_tokens, ttft_s, tokens_per_s, created_at,"
            " model) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (chat_id, role, content, finish_reason, num_tokens, ttft_s, tokens_per_s, now, model),
        )
        return MessageRecord(message_id, chat_id, role, content, finish_reason, num_tokens, ttft_s, tokens_per_s, now,
                             model)

    def update_reply(self, message: MessageRecord, content: str, *, finish_reason: str | None, num_tokens: int,
                     ttft_s: float | None, tokens_per_s: float | None) -> MessageRecord:
        """A reply committed while it grows: its text so far, or its final text and metadata."""
        self._write(
            "UPDATE messages SET content = ?, finish_reason = ?, num_tokens = ?, ttft_s = ?, tokens_per_s = ?"
            " WHERE id = ?", (content, finish_reason, num_tokens, ttft_s, tokens_per_s, message.id))
        return MessageRecord(message.id, message.chat_id, message.role, content, finish_reason, num_tokens, ttft_s,
                             tokens_per_s, message.created_at, message.model)

    def messages(self, chat_id: int) -> list[MessageRecord]:
        rows = self._db.execute(
            f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE chat_id = ? ORDER BY id", (chat_id,)
        ).fetchall()
        return [MessageRecord(*row) for row in rows]

    def count_messages(self, chat_id: int) -> int:
        return self._db.execute("SELECT COUNT(*) FROM messages WHERE chat_id = ?", (chat_id,)).fetchone()[0]

    def delete_message(self, message_id: int) -> None:
        self._write("DELETE FROM messages WHERE id = ?", (message_id,))

    # app state

    def get_meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def set_meta(self, key: str, value: str) -> None:
        self._write("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                    (key, value))


class _Transaction:
    """BEGIN/COMMIT around a migration so a failed one leaves the file at the old version."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN")

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._db.execute("COMMIT" if exc_type is None else "ROLLBACK")
