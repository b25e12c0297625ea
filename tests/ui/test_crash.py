"""The app killed with SIGKILL while four tabs stream: on the next start every chat is there with
its prompt and each reply up to its last commit (about a second before the kill), marked as cut
off, and the SQLite file passes its integrity check."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from app.ui.session import reply as chat_module
from app.ui.message_list import meta_line
from app.ui.store import INTERRUPTED, STREAMING, ChatStore

REPO = Path(__file__).resolve().parents[2]

# Four tabs broadcast one prompt to a slow fake engine, then the app keeps streaming until killed.
APP = """
import asyncio, sys
from pathlib import Path
from app.ui.screen import ChatScreen
from app.ui.widgets import PromptInput
from tests.support.fake_engine import FakeEngine
from tests.ui.test_tui import make_app, chat_screen

async def main(tmp: Path) -> None:
    app, _ = make_app(tmp, FakeEngine(model_name="fake", max_model_len=4096, step_delay=0.02))
    async with app.run_test(size=(120, 40)) as pilot:
        await chat_screen(pilot)
        for _ in range(3):
            await pilot.press("ctrl+n")
            await pilot.pause()
        pilot.app.screen.active_pane().query_one(PromptInput).insert("tell me a long story")
        await pilot.press("ctrl+b")
        print("sent", flush=True)
        await asyncio.sleep(600)

asyncio.run(main(Path(sys.argv[1])))
"""


def _streaming_replies(db: Path) -> int:
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
            return con.execute("SELECT COUNT(*) FROM messages WHERE finish_reason = ? AND length(content) > 0",
                               (STREAMING,)).fetchone()[0]
    except sqlite3.Error:
        return 0


def test_sigkill_while_four_tabs_stream_loses_no_chat(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", APP, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    db = tmp_path / "data" / "chats.sqlite3"
    try:
        deadline = time.monotonic() + 120
        while _streaming_replies(db) < 4:
            assert proc.poll() is None, "the app exited before its replies streamed"
            assert time.monotonic() < deadline, "four replies were never committed while streaming"
            time.sleep(0.2)
        time.sleep(2.5 * chat_module.COMMIT_EVERY_S)  # a few more commits, then the kill mid-stream
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    with sqlite3.connect(db) as con:
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    store = ChatStore.in_dir(tmp_path / "data")
    chats = store.chats()
    assert len(chats) == 4
    for chat in chats:
        messages = store.messages(chat.id)
        assert [m.role for m in messages] == ["user", "assistant"]
        assert messages[0].content == "tell me a long story"
        reply = messages[1]
        assert reply.content and reply.finish_reason == INTERRUPTED and reply.num_tokens > 0
        assert "cut off" in meta_line(reply.num_tokens, reply.tokens_per_s, reply.ttft_s, reply.finish_reason)
    store.close()


def _read_only(store: ChatStore) -> None:
    """Every later write fails as on a read-only or full disk (root ignores file modes)."""
    store._db.close()
    store._db = sqlite3.connect(f"file:{store.path}?mode=ro", uri=True, isolation_level=None)


def test_a_store_that_cannot_be_written_says_so_once_and_keeps_going(tmp_path: Path) -> None:
    store = ChatStore.in_dir(tmp_path)
    chat = store.create_chat("Chat 1")
    said: list[str] = []
    store.on_write_error = said.append
    _read_only(store)
    message = store.add_message(chat.id, "user", "hello")
    reply = store.add_message(chat.id, "assistant", "hi", finish_reason=STREAMING, num_tokens=1)
    store.update_reply(reply, "hi there", finish_reason="stop", num_tokens=2, ttft_s=None, tokens_per_s=None)
    assert message.id < 0 and reply.id < 0 and message.content == "hello"
    assert len(said) == 1 and "cannot save chats" in said[0] and str(store.path) in said[0]
    assert store.create_chat("Chat 2").id < 0
    assert [c.title for c in store.chats()] == ["Chat 1"]  # reads still work
    store.close()


async def test_the_app_keeps_chatting_when_its_store_goes_read_only(tmp_path: Path) -> None:
    from tests.support.fake_engine import FakeEngine, echo_reply
    from tests.ui.test_tui import SIZE, chat_screen, idle, make_app, type_and_send

    app, _ = make_app(tmp_path, FakeEngine(model_name="fake", max_model_len=4096, script=echo_reply))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        _read_only(app.store)
        await type_and_send(pilot, "first")
        await idle(pilot, screen)
        await type_and_send(pilot, "second")
        await idle(pilot, screen)
        pane = screen.active_pane()
        assert [m.content for m in pane.session.messages] == ["first", "Reply to: first", "second", "Reply to: second"]
        warnings = [n for n in app._notifications if n.title == "Chats not saved"]
        assert len(warnings) == 1
