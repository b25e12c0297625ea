"""A model without a chat template (a base model) runs its tabs in completion mode: the prompt is a
plain-text transcript the model continues, "\\nUser:" ends the reply, and the header says so. A
chat model still gets its chat messages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from textual.widgets import Markdown, Static

from app.engine.api.engine_client import Prompt
from app.ui.session.history import BASE_MODEL_STOP, completion_prompt
from tests.support.fake_engine import FakeEngine, echo_reply
from tests.ui.test_tui import SIZE, chat_screen, idle, make_app, type_and_send


def engine(chat_template: bool, **settings: Any) -> FakeEngine:
    return FakeEngine(**{"model_name": "fake-model-q4", "max_model_len": 4096, "script": echo_reply,
                         "chat_template": chat_template, **settings})


def test_completion_prompt_is_a_plain_transcript_ending_with_the_assistant_turn() -> None:
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi "},
               {"role": "assistant", "content": " hello"}, {"role": "user", "content": "bye"}]
    assert completion_prompt(history) == "Be brief.\n\nUser: hi\nAssistant: hello\nUser: bye\nAssistant:"
    assert completion_prompt([{"role": "user", "content": "x"}]) == "User: x\nAssistant:"


async def test_base_model_sends_plain_text_with_a_user_stop_and_says_so(tmp_path: Path) -> None:
    app, fake = make_app(tmp_path, engine(False))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        info = str(screen.query_one("#model-info", Static).render())
        assert "base model: continues text" in info
        pane = screen.active_pane()
        await type_and_send(pilot, "tell me about paging")
        await idle(pilot, screen)
        await type_and_send(pilot, "and more")
        await idle(pilot, screen)
        first, second = fake.submitted
        assert first.prompt == "User: tell me about paging\nAssistant:"
        assert isinstance(second.prompt, str) and "tell me about paging" in second.prompt
        # echo_reply echoes a text prompt whole: the first reply, then the new turn.
        first_reply = "Reply to: User: tell me about paging Assistant:"
        assert second.prompt == f"{first.prompt} {first_reply}\nUser: and more\nAssistant:"
        assert BASE_MODEL_STOP in first.params.stop and first.params.stop == ["\nUser:"]
        assert first.params.temperature == 0.7 and first.params.max_tokens == 512  # the tab's settings
        assert pane.query(Markdown).last().source.endswith("User: and more Assistant:")


async def test_base_model_reply_ends_where_the_model_starts_the_next_user_turn(tmp_path: Path) -> None:
    def rambling(prompt: Prompt) -> list[str]:
        return ["Sure", " thing", "\nUser:", " go on", "\nAssistant:", " more"]

    app, fake = make_app(tmp_path, engine(False, script=rambling))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        pane = screen.active_pane()
        await type_and_send(pilot, "hello")
        await idle(pilot, screen)
        stored = app.store.messages(pane.session.chat.id)
        assert [(m.role, m.content) for m in stored] == [("user", "hello"), ("assistant", "Sure thing")]
        assert stored[1].finish_reason == "stop"


async def test_chat_model_sends_messages_and_no_base_model_note(tmp_path: Path) -> None:
    app, fake = make_app(tmp_path, engine(True))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        assert "base model" not in str(screen.query_one("#model-info", Static).render())
        await type_and_send(pilot, "hi there")
        await idle(pilot, screen)
        prompt, params, _ = fake.submitted[0]
        assert prompt == [{"role": "user", "content": "hi there"}]
        assert not params.stop


async def test_no_chat_model_pulled_says_how_to_get_one(tmp_path: Path, monkeypatch: Any) -> None:
    from app.engine.gguf import catalog

    monkeypatch.setattr(catalog, "installed_path", lambda name: None)
    app, _ = make_app(tmp_path, engine(False))
    async with app.run_test(size=SIZE) as pilot:
        await chat_screen(pilot)
        notes = [n.message for n in app._notifications]
        assert any(f"localbatch pull {catalog.CHAT_DEFAULT}" in m and "f5" in m for m in notes), notes


async def test_no_hint_once_a_chat_model_is_pulled(tmp_path: Path, monkeypatch: Any) -> None:
    from app.engine.gguf import catalog

    monkeypatch.setattr(catalog, "installed_path", lambda name: tmp_path / f"{name}.gguf")
    app, _ = make_app(tmp_path, engine(False))
    async with app.run_test(size=SIZE) as pilot:
        await chat_screen(pilot)
        assert not any("No chat model" in (n.title or "") for n in app._notifications)
