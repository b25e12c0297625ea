"""Writing a message, driven through the real app with Pilot over the fake engine: attaching
files (the picker, `@path`), the context meter and its cost estimate, the overflow policy (the
trimmed history the engine receives), taking the last turn back to edit it, editing an earlier
message in a fork, and walking the prompts sent before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from textual.widgets import Input, OptionList

from app.engine.types.context_window import OVERFLOW_STOP, drop_oldest_turns, without_turns
from app.engine.types.errors import RequestError
from app.ui.attach import (
    MAX_FILE_BYTES,
    AttachError,
    Attachment,
    complete_path,
    compose_message,
    display_text,
    mentioned_files,
    read_attachment,
    split_message,
)
from app.ui.attach_dialog import AttachDialog
from app.ui.dialogs import MessagePicker
from app.ui.user_config import ChatSettings, ConfigError, parse_config
from app.ui.widgets import AttachmentsLine, ContextMeter, MessageView, PromptInput, usage_text
from tests.ui.test_tui import SIZE, chat_engine, chat_screen, idle, make_app, type_and_send, until


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory with a source file, a binary file and a folder."""
    root = tmp_path / "project"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "palindrome.py").write_text("def is_palindrome(s):\n    return s == s[::-1]\n")
    (root / "pkg" / "notes.md").write_text("# notes\n```sh\nls\n```\n")
    (root / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    monkeypatch.chdir(root)
    return root


def notices(screen: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    said: list[str] = []
    monkeypatch.setattr(screen.app, "notify", lambda message, **kw: said.append(message))
    return said


# --- files ---------------------------------------------------------------------------------------


def test_a_file_goes_first_as_a_fenced_block_and_comes_back_out(project: Path) -> None:
    file = read_attachment("pkg/palindrome.py")
    assert (file.language, file.num_lines) == ("python", 2)
    content = compose_message([file], "make it ignore case")
    assert content.startswith("File: pkg/palindrome.py\n```python\ndef is_palindrome(s):")
    assert content.endswith("```\n\nmake it ignore case")
    files, text = split_message(content)
    assert [(f.name, f.text, f.language) for f in files] == [("pkg/palindrome.py", file.text, "python")]
    assert text == "make it ignore case"
    assert display_text(content) == "📎 pkg/palindrome.py (2 lines)\nmake it ignore case"


def test_a_fence_inside_a_file_gets_a_longer_fence(project: Path) -> None:
    file = read_attachment("pkg/notes.md")
    block = file.block()
    assert block.startswith("File: pkg/notes.md\n````markdown\n") and block.endswith("\n````\n")
    files, text = split_message(compose_message([file, read_attachment("pkg/palindrome.py")], "hi"))
    assert [f.name for f in files] == ["pkg/notes.md", "pkg/palindrome.py"] and files[0].text == file.text
    assert text == "hi"


def test_binary_oversized_missing_and_folders_are_refused_with_a_reason(project: Path) -> None:
    (project / "big.txt").write_text("x" * (MAX_FILE_BYTES + 1))
    (project / "latin1.txt").write_bytes("café".encode("latin-1"))
    reasons = {}
    for name in ("blob.bin", "big.txt", "nope.py", "pkg", "latin1.txt"):
        with pytest.raises(AttachError) as e:
            read_attachment(name)
        reasons[name] = str(e.value)
    assert reasons["blob.bin"] == "blob.bin: a binary file; only text files can be attached"
    assert "over the 512 KiB" in reasons["big.txt"]
    assert reasons["nope.py"] == "nope.py: no such file"
    assert "is a directory" in reasons["pkg"]
    assert "not UTF-8" in reasons["latin1.txt"]
    assert all("\n" not in r for r in reasons.values())


def test_at_mentions_and_path_completion(project: Path) -> None:
    assert mentioned_files("look at @pkg/palindrome.py, and @missing.py or me@host") == ["pkg/palindrome.py"]
    assert complete_path("pk") == ["pkg/"]
    assert complete_path("pkg/p") == ["pkg/palindrome.py"]
    assert complete_path("pkg/") == ["pkg/notes.md", "pkg/palindrome.py"]
    assert complete_path("nothing/here") == []


async def test_the_picker_attaches_files_and_refuses_a_binary_one(project: Path, tmp_path: Path) -> None:
    app, engine = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        pane = screen.active_pane()
        await pilot.press("ctrl+o")
        await until(pilot, lambda: isinstance(app.screen, AttachDialog))
        dialog = app.screen
        await pilot.press(*"pkg/pa", "tab")  # completes the one match
        assert dialog.query_one("#attach-path", Input).value == "pkg/palindrome.py"
        await pilot.press("enter")
        await pilot.press(*"blob.bin", "enter")
        assert "blob.bin: a binary file" in str(dialog.query_one("#attach-error").render())
        dialog.query_one("#attach-path", Input).value = ""
        await pilot.press("enter")  # an empty line: done
        await until(pilot, lambda: app.screen is screen)
        assert [a.name for a in pane.session.draft.attachments] == ["pkg/palindrome.py"]
        assert "pkg/palindrome.py (2 lines)" in str(pane.query_one(AttachmentsLine).render())
        await type_and_send(pilot, "make it ignore case")
        await idle(pilot, screen)
        sent = engine.submitted[-1].prompt[-1]["content"]
        assert sent.startswith("File: pkg/palindrome.py\n```python\n") and sent.endswith("make it ignore case")
        assert app.store.messages(pane.session.chat.id)[0].content == sent
        assert pane.session.draft.attachments == [] and not pane.query_one(AttachmentsLine).display
        user_view = pane.query(MessageView).first()
        assert str(user_view.query_one(".body").render()).startswith("📎 pkg/palindrome.py (2 lines)")


async def test_at_path_with_tab_completes_and_the_file_is_sent_first(project: Path, tmp_path: Path) -> None:
    app, engine = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        pane = screen.active_pane()
        await pilot.press(*"explain @pkg/pal", "tab")
        assert pane.prompt.text == "explain @pkg/palindrome.py "
        await pilot.press(*"please", "enter")
        await idle(pilot, screen)
        sent = engine.submitted[-1].prompt[-1]["content"]
        assert sent.startswith("File: pkg/palindrome.py\n") and sent.endswith("explain @pkg/palindrome.py please")


# --- the context meter and the overflow policy -------------------------------------------------


def test_the_meter_line_says_use_room_and_cost() -> None:
    assert str(usage_text(1204, 0, 32768, 0, 0.0)) == "context 1,204 / 32,768 tok · 4%"
    line = str(usage_text(1204, 2140, 32768, 8192, 110.0))
    assert line == "context 1,204 / 32,768 tok · 4% · KV pool 8,192 · this message +2,140 tok, ~19 s to read"
    assert str(usage_text(10, 5, 0, 0, 0.0, approximate=True)) == "context ≈10 tok · this message +≈5 tok"
    assert str(usage_text(700, 0, 640, 0, 0.0, left_out=2)).endswith("· the model reads it without the oldest 2 messages")


async def test_the_meter_counts_the_chat_and_the_draft_with_the_engines_tokenizer(tmp_path: Path) -> None:
    app, engine = make_app(tmp_path, chat_engine(max_model_len=1000))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        pane = screen.active_pane()
        meter = pane.query_one(ContextMeter)
        await type_and_send(pilot, "hello")
        await idle(pilot, screen)
        history = engine.apply_chat_template(pane.session.history())
        assert str(meter.render()).startswith(f"context {len(engine.encode(history)):,} / 1,000 tok")
        pane.session.context.prefill_rate = 50.0
        await pilot.press(*"abcdefghij")
        adding = len(engine.encode(engine.apply_chat_template([{"role": "user", "content": "abcdefghij"}])))
        await until(pilot, lambda: f"this message +{adding} tok, ~1 s to read" in str(meter.render()))


async def test_past_80_percent_the_meter_warns_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app, _ = make_app(tmp_path, chat_engine(max_model_len=400), config="[sampling]\nmax_tokens = 40\n")
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        said = notices(screen, monkeypatch)
        pane = screen.active_pane()
        await type_and_send(pilot, "x" * 150)
        await idle(pilot, screen)
        assert pane.query_one(ContextMeter).has_class("warn")
        assert len([s for s in said if "of its 400-token context" in s]) == 1
        await type_and_send(pilot, "y")
        await idle(pilot, screen)
        assert len([s for s in said if "of its 400-token context" in s]) == 1


async def test_an_overflowing_chat_drops_its_oldest_turns_keeping_the_system_prompt(tmp_path: Path) -> None:
    config = 'system_prompt = "be brief"\n[sampling]\nmax_tokens = 50\n'
    app, engine = make_app(tmp_path, chat_engine(max_model_len=400), config=config)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        pane = screen.active_pane()
        for word in ("alpha", "bravo", "charlie", "delta"):
            await type_and_send(pilot, f"{word} " * 12)
            await idle(pilot, screen)
        sent = engine.submitted[-1].prompt
        assert sent[0] == {"role": "system", "content": "be brief"}
        assert sent[-1]["content"].startswith("delta")
        assert not any(m["content"].startswith("alpha") for m in sent)  # the oldest turn went first
        assert len(engine.encode(engine.apply_chat_template(sent))) <= 400 - 50
        assert len(pane.session.messages) == 8  # the chat itself keeps everything
        meta = str(pane.query(MessageView).last().query_one(".meta").render())
        assert "oldest messages left out to fit the context" in meta
        assert "the model reads it without the oldest" in str(pane.query_one(ContextMeter).render())


async def test_the_stop_policy_refuses_and_keeps_the_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = 'context_overflow = "stop"\n[sampling]\nmax_tokens = 50\n'
    app, engine = make_app(tmp_path, chat_engine(max_model_len=300), config=config)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        said = notices(screen, monkeypatch)
        pane = screen.active_pane()
        await type_and_send(pilot, "a " * 60)
        await idle(pilot, screen)
        submitted = len(engine.submitted)
        await type_and_send(pilot, "b " * 60)
        await pilot.pause()
        assert len(engine.submitted) == submitted and not pane.generating
        assert pane.prompt.text == "b " * 60  # nothing typed is lost
        assert any(s.startswith("this chat no longer fits the context") for s in said)


def test_overflow_policy_in_the_config_and_a_wrong_one_named() -> None:
    assert parse_config({"context_overflow": "stop"}).sampling.context_overflow == OVERFLOW_STOP
    with pytest.raises(ConfigError, match="context_overflow must be one of stop, drop_oldest"):
        parse_config({"context_overflow": "truncate"})
    with pytest.raises(RequestError):
        ChatSettings(context_overflow="nope").validate()


def test_dropping_turns_is_the_fewest_that_fit_and_never_the_last() -> None:
    messages = [{"role": "system", "content": "s"}]
    for i in range(6):
        messages += [{"role": "user", "content": f"u{i}" * 5}, {"role": "assistant", "content": f"a{i}" * 5}]
    messages.append({"role": "user", "content": "last"})

    def count(ms: list[dict[str, Any]]) -> int:
        return sum(len(m["content"]) for m in ms)

    for budget in range(count(without_turns(messages, 6)), count(messages) + 1, 7):
        kept, num_tokens = drop_oldest_turns(messages, count, budget)
        fewest = next(n for n in range(7) if count(without_turns(messages, n)) <= budget)
        assert kept == without_turns(messages, fewest) and num_tokens == count(kept)
        assert kept[0]["role"] == "system" and kept[-1]["content"] == "last"
    with pytest.raises(RequestError, match="even the last message alone"):
        drop_oldest_turns(messages, count, 3)


# --- taking a turn back, editing in a fork, prompt history -------------------------------------


async def test_edit_last_takes_the_turn_back_and_resending_replaces_it(project: Path, tmp_path: Path) -> None:
    app, engine = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        pane = screen.active_pane()
        await type_and_send(pilot, "first")
        await idle(pilot, screen)
        pane.session.draft.attach(["pkg/palindrome.py"])
        await type_and_send(pilot, "is it fast?")
        await idle(pilot, screen)
        await pilot.press("ctrl+up")
        await pilot.pause()
        assert pane.prompt.text == "is it fast?"
        assert [a.name for a in pane.session.draft.attachments] == ["pkg/palindrome.py"]
        assert [m.content for m in app.store.messages(pane.session.chat.id)] == ["first", "Reply to: first"]
        assert len(pane.query(MessageView)) == 2
        pane.prompt.clear()
        await type_and_send(pilot, "is it correct?")
        await idle(pilot, screen)
        stored = [m.content for m in app.store.messages(pane.session.chat.id)]
        assert len(stored) == 4 and stored[2].startswith("File: pkg/palindrome.py") and stored[2].endswith("correct?")
        first_prompt, last_prompt = engine.submitted[0].prompt, engine.submitted[-1].prompt
        assert last_prompt[:2] == [*first_prompt, {"role": "assistant", "content": "Reply to: first"}][:2]


async def test_edit_last_with_nothing_sent_or_while_generating_says_why(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    app, engine = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        said: list[str] = []
        monkeypatch.setattr(screen, "notify", lambda message, **kw: said.append(message))
        await pilot.press("ctrl+up")
        engine.paused = True
        await type_and_send(pilot, "hold on")
        await until(pilot, lambda: screen.active_pane().generating)
        await pilot.press("ctrl+up")
        engine.paused = False
        await idle(pilot, screen)
        assert said == ["No message of yours to edit yet", "Still generating: stop it first (escape)"]
        assert len(screen.active_pane().session.messages) == 2


async def test_edit_at_opens_a_fork_before_the_message_with_it_in_the_input(tmp_path: Path) -> None:
    app, _ = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        parent = screen.active_pane()
        for text in ("one", "two", "three"):
            await type_and_send(pilot, text)
            await idle(pilot, screen)
        await pilot.press("f6")
        await until(pilot, lambda: isinstance(app.screen, MessagePicker))
        options = app.screen.query_one(OptionList)
        assert options.option_count == 3  # only your messages
        await pilot.press("up", "enter")  # "two"
        await until(pilot, lambda: len(screen.panes()) == 2 and screen.active_pane() is not parent)
        await pilot.pause()
        fork = screen.active_pane()
        assert [m.content for m in fork.session.messages] == ["one", "Reply to: one"]
        assert fork.prompt.text == "two"
        assert len(parent.session.messages) == 6


async def test_up_and_down_in_an_empty_input_walk_the_prompts_sent(tmp_path: Path) -> None:
    app, _ = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        pane = screen.active_pane()
        for text in ("first prompt", "second\nprompt"):
            await type_and_send(pilot, text)
            await idle(pilot, screen)
        field = pane.query_one(PromptInput)
        await pilot.press("up")
        assert field.text == "second\nprompt"
        await pilot.press("up")
        assert field.text == "first prompt"
        await pilot.press("up")  # the oldest stays
        assert field.text == "first prompt"
        await pilot.press("down", "down")
        assert field.text == ""
        await pilot.press(*"typed", "up")  # text of your own: up is the editor's again
        assert field.text == "typed"
        # Another tab recalls its own prompts first, then every other chat's.
        await pilot.press("ctrl+n")
        await until(pilot, lambda: len(screen.panes()) == 2)
        await pilot.pause()
        await type_and_send(pilot, "in the new tab")
        await idle(pilot, screen)
        assert screen.active_pane().session.recall_prompts()[:3] == ["in the new tab", "second\nprompt", "first prompt"]


async def test_attach_keeps_the_good_files_and_returns_why_others_were_refused(project: Path, tmp_path: Path) -> None:
    app, engine = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        pane = screen.active_pane()
        assert pane.session.draft.attach(["blob.bin", "pkg/palindrome.py"]) == ["blob.bin: a binary file; only text files can be attached"]
        assert pane.session.draft.attachments == [Attachment("pkg/palindrome.py", read_attachment("pkg/palindrome.py").text, "python")]


async def test_a_chat_the_engine_cannot_count_says_so_under_the_input(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    app, engine = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        pane = screen.active_pane()

        def broken(*args: Any, **kwargs: Any) -> str:
            raise RequestError("bad chat message")

        monkeypatch.setattr(engine, "apply_chat_template", broken)
        await pilot.press(*"hello")
        meter = pane.query_one(ContextMeter)
        await until(pilot, lambda: "cannot count" in str(meter.render()))
        assert str(meter.render()) == "cannot count this chat's tokens: bad chat message"
        assert app.is_running
