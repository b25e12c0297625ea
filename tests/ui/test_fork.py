"""Forking a chat: a new tab with the history (all of it, or up to a chosen message), copied in
the store, whose next request starts with the parent's prompt tokens."""

from __future__ import annotations

from pathlib import Path

from textual.widgets import OptionList

from app.ui.dialogs import MessagePicker
from tests.ui.test_tui import SIZE, chat_screen, idle, make_app, type_and_send, until


async def test_fork_copies_history_and_reuses_the_prompt(tmp_path: Path) -> None:
    app, engine = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        parent = screen.active_pane()
        for text in ("first", "second"):
            await type_and_send(pilot, text)
            await idle(pilot, screen)
        await pilot.press("ctrl+f")
        await until(pilot, lambda: len(screen.panes()) == 2 and screen.active_pane() is not parent)
        fork = screen.active_pane()
        assert fork.session.chat.title.endswith("(fork)")
        assert [(m.role, m.content) for m in fork.session.messages] == [(m.role, m.content) for m in parent.session.messages]
        assert [m.content for m in app.store.messages(fork.session.chat.id)] == [m.content for m in parent.session.messages]
        await type_and_send(pilot, "third, in the fork")
        await idle(pilot, screen)
        parent_prompt, fork_prompt = engine.submitted[1].prompt, engine.submitted[-1].prompt
        assert fork_prompt[: len(parent_prompt)] == parent_prompt  # the shared prefix the cache serves
        assert len(parent.session.messages) == 4  # the parent is untouched


async def test_fork_at_a_chosen_message(tmp_path: Path) -> None:
    app, _ = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        for text in ("one", "two"):
            await type_and_send(pilot, text)
            await idle(pilot, screen)
        await pilot.press("ctrl+g")
        await until(pilot, lambda: isinstance(app.screen, MessagePicker))
        options = app.screen.query_one(OptionList)
        assert options.option_count == 4 and options.highlighted == 3
        options.highlighted = 1  # after the first reply
        await pilot.press("enter")
        await until(pilot, lambda: len(screen.panes()) == 2)
        await pilot.pause()
        assert [m.content for m in screen.active_pane().session.messages][0] == "one"
        assert len(screen.active_pane().session.messages) == 2
