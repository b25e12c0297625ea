"""Tool turns stored with a chat (as the tool loop will leave them) in the app: shown, sent to the
model as OpenAI-style messages, regenerated and forked as whole turns, found by search."""

from __future__ import annotations

from pathlib import Path

from app.ui.store import ChatStore
from app.ui.widgets import MessageView
from tests.support.fake_engine import ToolTemplateEngine, echo_reply
from tests.ui.test_tui import SIZE, chat_screen, idle, make_app, until

CALL = {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}


def chat_with_a_tool_turn(tmp_path: Path) -> None:
    store = ChatStore.in_dir(tmp_path / "data")
    chat = store.create_chat("tools")
    store.add_message(chat.id, "user", "what is in a.py?")
    store.add_message(chat.id, "assistant", "", tool_calls=[CALL], finish_reason="stop", num_tokens=9, model="m")
    store.add_message(chat.id, "tool", "x = 1", tool_call_id="call_1", name="read_file")
    store.add_message(chat.id, "assistant", "It sets x.", finish_reason="stop", num_tokens=4, model="m")
    store.close()


async def test_a_stored_tool_turn_is_shown_sent_and_regenerated_whole(tmp_path: Path) -> None:
    chat_with_a_tool_turn(tmp_path)
    engine = ToolTemplateEngine(model_name="fake", max_model_len=4096, script=echo_reply)
    app, _ = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        pane = screen.active_pane()
        await until(pilot, lambda: len(pane.query(MessageView)) == 4)
        views = list(pane.query(MessageView))
        assert [v.role for v in views] == ["user", "assistant", "tool", "assistant"]
        assert views[1]._content == '→ read_file({"path": "a.py"})' and views[2]._content == "x = 1"
        assert sorted(h.message_index for h in app.store.search("read_file")) == [1, 2]
        await pilot.press("ctrl+f")  # a fork copies the calls and their result
        await until(pilot, lambda: len(screen.panes()) == 2)
        fork = screen.active_pane()
        assert [(m.role, m.tool_calls, m.tool_call_id) for m in fork.session.messages] == [
            (m.role, m.tool_calls, m.tool_call_id) for m in pane.session.messages]
        screen.query_one("TabbedContent").active = pane.id
        await pilot.pause()
        await pilot.press("ctrl+r")  # the turn's call, result and answer go; one reply comes
        await idle(pilot, screen)
        assert engine.submitted[-1].prompt == [{"role": "user", "content": "what is in a.py?"}]
        stored = app.store.messages(pane.session.chat.id)
        assert [(m.role, m.content) for m in stored] == [("user", "what is in a.py?"),
                                                         ("assistant", "Reply to: what is in a.py?")]
        await until(pilot, lambda: [v.role for v in pane.query(MessageView)] == ["user", "assistant"])
