"""`ChatSession` without a screen: what it sends (messages, fit, sampling), what it commits, how it
edits (regenerate, take-back, fork) and how tool turns sit in its history, over the fake engine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from app.engine.types.context_window import OVERFLOW_STOP, ContextOverflowError
from app.tools.guidance import tools_guidance
from app.ui.session import reply as reply_module
from app.ui.session.history import BASE_MODEL_STOP, chat_message
from app.ui.session.reply import Reply, ReplyEnd
from app.ui.session.session import ATTACHMENTS, GENERATING, TITLE, ChatSession
from app.ui.store import STREAMING, ChatStore, MessageRecord
from app.ui.user_config import ChatSettings
from tests.support.fake_engine import FakeEngine, ToolTemplateEngine, echo_reply

CALL = {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}


class Sink:
    def __init__(self) -> None:
        self.parts: list[str] = []
        self.calls: list[str] = []  # the tools the reply began calls to

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def write(self, text: str) -> None:
        if text:
            self.parts.append(text)

    def calling(self, name: str) -> None:
        self.calls.append(name)


class View:
    """A view that records what `respond` asks of it."""

    def __init__(self) -> None:
        self.sinks: list[Sink] = []
        self.ended: list[tuple[MessageRecord | None, ReplyEnd]] = []
        self.results: list[MessageRecord] = []
        self.notes: list[str] = []

    async def opened(self, reply: Reply) -> Sink:
        self.sinks.append(Sink())
        return self.sinks[-1]

    async def closing(self, reply: Reply, end: ReplyEnd) -> None:
        pass

    def closed(self, reply: Reply, message: MessageRecord | None, end: ReplyEnd) -> None:
        self.ended.append((message, end))

    def tool_result(self, message: MessageRecord) -> None:
        self.results.append(message)

    def note(self, text: str) -> None:
        self.notes.append(text)


def session_for(tmp_path: Path, engine: Any = None, settings: ChatSettings | None = None,
                system_prompt: str = "") -> tuple[ChatSession, ChatStore, Any]:
    engine = engine or FakeEngine(script=echo_reply, max_model_len=4096)
    store = ChatStore(tmp_path / "chats.sqlite3")
    chat = store.create_chat("Chat 1", system_prompt, settings)
    return ChatSession(chat, [], engine, store), store, engine


async def send(session: ChatSession, text: str) -> View:
    content, plan = session.prepare_message(text)
    session.add_user_message(text, content, plan)
    view = View()
    await session.respond(session.begin_reply(), view)
    return view


async def test_a_reply_is_sent_as_messages_and_committed(tmp_path: Path) -> None:
    session, store, engine = session_for(tmp_path, system_prompt="Be brief.")
    changes: list[str] = []
    session.on_change = changes.append
    view = await send(session, "hello there friend")
    prompt, params = engine.submitted[-1].prompt, engine.submitted[-1].params
    assert prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there friend"}]
    assert params.max_tokens == 512 and params.temperature == 0.7
    assert view.sinks[0].text == "Reply to: hello there friend"
    assert [(m.role, m.content) for m in store.messages(session.chat.id)] == [
        ("user", "hello there friend"), ("assistant", "Reply to: hello there friend")]
    assert session.messages == store.messages(session.chat.id)
    reply = session.messages[-1]
    assert reply.finish_reason == "stop" and reply.model == engine.model_name and reply.num_tokens > 0
    assert session.chat.title == "hello there friend"  # "Chat N" takes its title from the first message
    assert changes == [ATTACHMENTS, TITLE, GENERATING, GENERATING] and not session.generating
    assert session.reply.finish_reason == "stop" and session.request_id is None


async def test_a_growing_reply_is_committed_as_it_streams(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reply_module, "COMMIT_EVERY_S", 0.0)
    session, store, _ = session_for(tmp_path)
    seen: list[tuple[str, str | None]] = []

    class Watching(Sink):
        def write(self, text: str) -> None:
            super().write(text)
            rows = store.messages(session.chat.id)
            if len(rows) == 2:
                seen.append((rows[1].content, rows[1].finish_reason))

    class WatchingView(View):
        async def opened(self, reply: Reply) -> Sink:
            self.sinks.append(Watching())
            return self.sinks[-1]

    content, plan = session.prepare_message("one two three four")
    session.add_user_message("one two three four", content, plan)
    await session.respond(session.begin_reply(), WatchingView())
    assert seen and all(finish == STREAMING for _, finish in seen)
    assert store.messages(session.chat.id)[1].finish_reason == "stop"


async def test_stop_commits_what_was_written(tmp_path: Path) -> None:
    engine = FakeEngine(script=echo_reply, max_model_len=4096)
    session, store, _ = session_for(tmp_path, engine)
    engine.hold_after = 3

    class Stopping(View):
        async def opened(self, reply: Reply) -> Sink:
            sink = await super().opened(reply)
            original = sink.write

            def write(text: str) -> None:
                original(text)
                if len(sink.parts) == 3:
                    assert session.stop()

            sink.write = write  # type: ignore[method-assign]
            return sink

    content, plan = session.prepare_message("a b c d e f")
    session.add_user_message("a b c d e f", content, plan)
    await session.respond(session.begin_reply(), Stopping())
    last = store.messages(session.chat.id)[-1]
    assert (last.role, last.finish_reason) == ("assistant", "abort") and last.content
    assert session.reply.request_id in engine.aborted and not session.stop()


async def test_a_failed_request_stores_no_reply(tmp_path: Path) -> None:
    session, store, _ = session_for(tmp_path, settings=ChatSettings(json_mode=True, json_schema="not json"))
    view = await send(session, "hi")
    message, end = view.ended[0]
    assert message is None and end.finish_reason == "error" and "JSON schema is not valid JSON" in end.error
    assert [m.role for m in store.messages(session.chat.id)] == ["user"]


async def test_the_oldest_turns_are_left_out_to_fit_and_stop_refuses(tmp_path: Path) -> None:
    engine = FakeEngine(script=echo_reply, max_model_len=256)
    session, _, _ = session_for(tmp_path, engine, settings=ChatSettings(max_tokens=32))
    for i in range(4):
        await send(session, f"turn {i} " + "word " * 12)
    assert session.context.plan.left_out > 0 and session.left_out_messages() == 2 * session.context.plan.left_out
    sent = engine.submitted[-1].prompt
    assert sent[0]["content"].startswith("turn ") and len(sent) < 2 * 4 - 1
    assert engine.tokenizer.encode(engine.apply_chat_template(sent)).__len__() <= 256 - 32
    session.update_settings("", ChatSettings(max_tokens=32, context_overflow=OVERFLOW_STOP))
    with pytest.raises(ContextOverflowError, match="no longer fits the context"):
        session.prepare_message("one more " * 10)
    assert len(session.messages) == 8  # nothing was added


async def test_max_tokens_is_cut_to_what_the_context_leaves(tmp_path: Path) -> None:
    engine = FakeEngine(script=echo_reply, max_model_len=128)
    session, _, _ = session_for(tmp_path, engine, settings=ChatSettings(max_tokens=100))
    await send(session, "x " * 30)
    params = engine.submitted[-1].params
    assert params.max_tokens == 128 - session.context.plan.used < 100


async def test_a_base_model_reads_a_transcript(tmp_path: Path) -> None:
    engine = FakeEngine(script=echo_reply, max_model_len=4096, chat_template=False)
    session, _, _ = session_for(tmp_path, engine)
    await send(session, "continue this")
    prompt, params = engine.submitted[-1].prompt, engine.submitted[-1].params
    assert prompt == "User: continue this\nAssistant:" and BASE_MODEL_STOP in params.stop


async def test_regenerate_take_back_and_fork_work_on_whole_turns(tmp_path: Path) -> None:
    session, store, _ = session_for(tmp_path)
    await send(session, "first")
    session.add_user_message("second", "second", session.prepare_message("second")[1])
    reply = store.add_message(session.chat.id, "assistant", "", tool_calls=[CALL])
    result = store.add_message(session.chat.id, "tool", "print(1)", tool_call_id="call_1", name="read_file")
    session._messages += [reply, result]  # as the tool loop leaves them
    forked, copied = session.fork(3)  # at the assistant's call: its result comes along
    assert copied == 5 and [m.role for m in store.messages(forked.id)] == ["user", "assistant", "user", "assistant",
                                                                          "tool"]
    assert store.messages(forked.id)[-2].tool_calls == [CALL] and store.messages(forked.id)[-1].name == "read_file"
    assert forked.title == f"{session.chat.title} (fork)"
    session.prepare_regenerate()
    dropped = session.drop_last_replies()
    assert [m.role for m in dropped] == ["assistant", "tool"] and session.messages[-1].content == "second"
    taken = session.take_back_last_turn()
    assert [m.content for m in taken] == ["second"] and [m.role for m in store.messages(session.chat.id)] == [
        "user", "assistant"]
    edit, content = session.fork_to_edit(0)
    assert content == "first" and store.messages(edit.id) == []


async def test_tool_turns_render_as_openai_messages(tmp_path: Path) -> None:
    engine = ToolTemplateEngine(script=echo_reply, max_model_len=4096)
    session, store, _ = session_for(tmp_path, engine)
    session.add_user_message("read it", "read it", session.prepare_message("read it")[1])
    call = store.add_message(session.chat.id, "assistant", "", tool_calls=[CALL])
    result = store.add_message(session.chat.id, "tool", "print(1)", tool_call_id="call_1", name="read_file")
    assert chat_message(call) == {"role": "assistant", "content": "", "tool_calls": [CALL]}
    assert chat_message(result) == {"role": "tool", "content": "print(1)", "tool_call_id": "call_1",
                                    "name": "read_file"}
    reopened = ChatSession(session.chat, store.messages(session.chat.id), engine, store)
    history = reopened.history()
    assert history[1:] == [chat_message(call), chat_message(result)]
    assert '<tool_call>{"name": "read_file"' in engine.apply_chat_template(history)
    assert reopened.chat_tokens() == len(engine.encode(engine.apply_chat_template(history)))


async def test_the_tool_loop_appends_results_and_continues(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The seam `respond` keeps for tool turns: a reply ending in calls, results appended, the next reply."""
    engine = ToolTemplateEngine(script=echo_reply, max_model_len=4096)
    session, store, _ = session_for(tmp_path, engine)
    stream = Reply.stream
    ends = iter([ReplyEnd("stop", tool_calls=[CALL])])

    async def calling(self: Reply, *args: Any) -> ReplyEnd:
        end = await stream(self, *args)
        return next(ends, end)

    class Runner:
        limit_reached = cancelled = False
        limit_message = ""

        def __init__(self) -> None:
            self.calls: list[list[dict[str, Any]]] = []

        def offered(self) -> list[dict[str, Any]]:
            return []

        def new_turn(self) -> None:
            pass

        async def run(self, calls: list[dict[str, Any]], cut: str | None = None) -> list[tuple[str, str, str]]:
            self.calls.append(calls)
            return [(c["id"], c["function"]["name"], "print(1)") for c in calls]

    monkeypatch.setattr(Reply, "stream", calling)
    session.tool_runner = runner = Runner()
    view = await send(session, "read a.py")
    assert runner.calls == [[CALL]] and len(view.sinks) == 2
    roles = [(m.role, bool(m.tool_calls), m.tool_call_id) for m in store.messages(session.chat.id)]
    assert roles == [("user", False, None), ("assistant", True, None), ("tool", False, "call_1"),
                     ("assistant", False, None)]
    assert engine.submitted[-1].prompt[-1] == {"role": "tool", "content": "print(1)", "tool_call_id": "call_1",
                                               "name": "read_file"}
    assert not session.generating


async def test_a_request_with_tools_opens_with_their_guidance(tmp_path: Path) -> None:
    """The guidance the benchmark measures goes in front of the chat's system prompt, with tools only."""
    session, _, _ = session_for(tmp_path, system_prompt="Be terse.")
    tool = {"type": "function", "function": {"name": "files__read_file", "parameters": {"type": "object"}}}

    class Runner:
        def offered(self) -> list[dict[str, Any]]:
            return [tool]

    content, plan = session.prepare_message("where is slugify?")
    session.add_user_message("where is slugify?", content, plan)
    assert session.request()[0][0] == {"role": "system", "content": "Be terse."}
    session.tool_runner = Runner()  # type: ignore[assignment]
    prompt = session.request()[0]
    assert prompt[0]["role"] == "system" and prompt[0]["content"].startswith(tools_guidance([tool]) + "\n\nBe terse.")


async def test_drafts_and_recall(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.py").write_text("x = 1\n")
    session, store, _ = session_for(tmp_path)
    assert session.draft.attach(["a.py", "missing.py"]) == ["missing.py: no such file"]
    assert session.draft_tokens("see") > session.draft_tokens("") > 0
    await send(session, "see")
    assert session.draft.attachments == [] and session.messages[0].content.startswith("File: a.py\n```python\n")
    other = store.create_chat("other")
    store.add_message(other.id, "user", "elsewhere")
    assert session.recall_prompts() == ["see", "elsewhere"]


def test_the_session_imports_no_textual_or_rich() -> None:
    code = ("import sys, app.ui.session.session; "
            "print([m for m in sys.modules if m.split('.')[0] in ('textual', 'rich')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "[]"


async def test_a_call_cut_by_max_tokens_is_answered_with_the_cause_and_the_cap(tmp_path: Path) -> None:
    """The reply ends at max_tokens inside a call: the model is told why in one line (the chat
    shows the same result), and goes on; cut before it was a call, the chat says so in a note."""
    from app.tools.manager import ToolInfo
    from app.tools.results import ToolResult
    from app.ui.session.tools import ChatTools
    from tests.support.fake_engine import FakeTokenizer

    echo = ToolInfo("fx", "echo", "fx__echo", "Repeat.", {"type": "object", "properties": {"text": {"type": "string"}}},
                    auto_approve=True)

    class Source:
        def offered_tools(self) -> list[ToolInfo]:
            return [echo]

        def find(self, offered: str) -> ToolInfo | None:
            return echo if offered == echo.offered_name else None

        async def call_async(self, offered: str, arguments: Any, timeout: float | None = None) -> ToolResult:
            raise AssertionError("a cut call must not run")

    pieces = {"echo": ["<tool_call>", '\n{"name": "fx__echo", ', '"arguments": {"text": "h', "i", "i", "i"],
              "name": ["<tool_call>", '\n{"na', 'me": "fx__', 'echo"', ', "arguments": {}}']}

    def script(prompt: Any) -> list[str]:
        text = FakeTokenizer().decode(prompt)
        turn = text.rsplit("<user>", 1)[-1]
        return ["Shorter then."] if "<tool>" in turn else pieces[turn.split("\n", 1)[0].strip()]

    engine = ToolTemplateEngine(script=script, max_model_len=4096)
    session, store, _ = session_for(tmp_path, engine, ChatSettings(max_tokens=4))
    session.tool_runner = ChatTools(Source(), 8)
    view = await send(session, "echo")
    said = "Error: the call was cut at the 4-token limit of a reply; write a shorter call"
    assert [(m.role, m.content) for m in store.messages(session.chat.id)][2:] == [("tool", said),
                                                                                   ("assistant", "Shorter then.")]
    assert [m.content for m in view.results] == [said] and view.notes == []

    view = await send(session, "name")  # cut in the name: `<tool_call>\n{"name": "fx__echo`, no call
    note = "The call was cut at the 4-token limit of a reply; no call ran (raise max tokens in the chat's settings)"
    assert view.notes == [note]
