"""The app's frame budget (Pilot, fake engine): a long chat opens without mounting its whole history,
a hidden tab buffers its stream and shows it complete once shown, switching tabs stays quick."""

from __future__ import annotations

import time
from pathlib import Path

from textual.widgets import TabbedContent

from app.ui.message_list import HISTORY_PAGE
from app.ui.reply_stream import DELTA_MAX_DELAY_S
from app.ui.store import ChatStore
from app.ui.widgets import EarlierMessages, MessageView
from tests.ui.test_tui import (
    SIZE,
    chat_engine,
    chat_screen,
    idle,
    make_app,
    type_and_send,
    until,
)


def long_chat(tmp_path: Path, num_messages: int) -> None:
    store = ChatStore.in_dir(tmp_path / "data")
    chat = store.create_chat("Long chat")
    for i in range(num_messages):
        role = "user" if i % 2 == 0 else "assistant"
        text = f"question {i}" if role == "user" else f"Answer {i}:\n\n- a **list**\n- of items\n\n```\ncode {i}\n```"
        store.add_message(chat.id, role, text, finish_reason="stop" if role == "assistant" else None,
                          num_tokens=20 if role == "assistant" else 0)
    store.create_chat("Short chat")
    store.close()


async def test_a_200_message_chat_opens_with_one_page_mounted(tmp_path: Path) -> None:
    long_chat(tmp_path, 200)
    app, _ = make_app(tmp_path)
    started = time.perf_counter()
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        pane = screen.panes()[0]
        await until(pilot, lambda: len(pane.query(MessageView)) == HISTORY_PAGE)
        opened_s = time.perf_counter() - started
        assert len(pane.session.messages) == 200
        earlier = pane.query_one(EarlierMessages)
        assert f"{200 - HISTORY_PAGE} earlier messages" in str(earlier.render())
        assert not screen.panes()[1].query(MessageView)  # the other tab mounts nothing until shown
        earlier.focus()  # the line sits above the visible bottom page: reach it by keyboard
        await pilot.press("enter")
        await until(pilot, lambda: len(pane.query(MessageView)) == 2 * HISTORY_PAGE)
        views = pane.query(MessageView)
        assert views.first()._content == pane.session.messages[200 - 2 * HISTORY_PAGE].content  # older page above
        assert views.last()._content == pane.session.messages[-1].content
    # A loose bound (CI machines are slow and shared); what it guards is "not seconds per 100 messages".
    assert opened_s < 10


async def test_the_built_screen_is_frozen_out_of_garbage_collection(tmp_path: Path) -> None:
    """Full collections while replies stream walked every widget of the screen (80 ms holding the
    GIL, a tab switch of 250 ms): the built screen is frozen, and thawed when it goes."""
    import gc

    long_chat(tmp_path, 40)
    app, _ = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        await until(pilot, lambda: gc.get_freeze_count() > 1000)
        assert screen.panes()[0].is_mounted
    assert gc.get_freeze_count() == 0


async def test_switching_tabs_is_quick_with_long_chats(tmp_path: Path) -> None:
    long_chat(tmp_path, 200)
    app, _ = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        app.animation_level = "none"  # time the switch, not the tab underline's animation
        tabs = screen.query_one(TabbedContent)
        first, second = screen.panes()
        timings = []
        for target in (second, first, second, first):
            started = time.perf_counter()
            tabs.active = target.id
            await pilot.pause()
            timings.append(time.perf_counter() - started)
        # The first switch to a long tab mounts one page; later switches mount nothing. The bound
        # is loose (Textual restyles and repaints the screen on a switch: ~0.1-0.3 s on a slow
        # 2-core VM); it catches a switch that mounts or re-parses the history again.
        assert len(first.query(MessageView)) == HISTORY_PAGE
        assert max(timings[2:]) < 1.5, timings


async def test_a_hidden_tab_buffers_its_stream_and_shows_it_complete(tmp_path: Path) -> None:
    engine = chat_engine(step_delay=0.005)
    app, _ = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        await screen.new_tab()
        await pilot.pause()
        first, second = screen.panes()
        tabs = screen.query_one(TabbedContent)
        tabs.active = first.id
        await pilot.pause()
        words = " ".join(f"w{i}" for i in range(60))
        engine.hold_after = 20
        first.query_one("PromptInput").insert(words)
        screen.action_command("broadcast")
        await until(pilot, lambda: engine.live_request_ids() and len(engine.live_request_ids()) == 2)
        await until(pilot, lambda: second.session.reply is not None and second.session.reply.metrics.num_tokens >= 20)
        view = second.query(MessageView).last()
        assert view.markdown.source == "" and not view.stream.text  # hidden: nothing painted yet
        tabs.active = second.id
        await until(pilot, lambda: "w17" in view.stream.text + view.markdown.source)
        engine.hold_after = None
        await idle(pilot, screen)
        expected = "Reply to: " + words
        assert second.session.messages[-1].content == expected
        assert view.markdown.source == expected and not view.stream.display
        assert engine.last_max_delay_s == DELTA_MAX_DELAY_S  # the UI need not be woken every step


async def test_history_never_takes_the_focus_and_scrolls_by_keys(tmp_path: Path) -> None:
    """A focusable history grabbed the focus on each switch (restyling every message twice)."""
    long_chat(tmp_path, 40)
    app, _ = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        tabs = screen.query_one(TabbedContent)
        first, second = screen.panes()
        focused = []
        app.screen.watch(app.screen, "focused", lambda widget: focused.append(widget), init=False)
        for target in (second, first):
            tabs.active = target.id
            await pilot.pause()
        assert not any(w is not None and w.has_class("messages") for w in focused), focused
        history = first.query_one(".messages")
        await until(pilot, lambda: history.max_scroll_y > 0 and history.scroll_y == history.max_scroll_y)
        await pilot.press("shift+pageup")
        await until(pilot, lambda: history.scroll_y < history.max_scroll_y)
        await pilot.press("shift+pagedown")
        await until(pilot, lambda: history.scroll_y == history.max_scroll_y)


async def test_a_reply_streams_below_its_question_and_keeps_its_place(tmp_path: Path) -> None:
    """The streaming body fills the view below the question (so a reply shorter than a screen
    never grows it: each growth lays out the screen), the question stays at the top, and the
    finished reply holds that height until the next message instead of scrolling the chat."""
    long_chat(tmp_path, 20)
    app, engine = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        pane = screen.active_pane()
        scroll = pane.query_one(".messages")
        engine.hold_after = 3
        await type_and_send(pilot, "a short question")
        await until(pilot, lambda: pane.generating and pane.query(MessageView).last().stream.line_count > 0)
        await pilot.pause(0.3)
        question, reply = list(pane.query(MessageView))[-2:]
        view_top = scroll.content_region.y
        assert question.region.y == view_top  # the question at the top, the reply's room below it
        assert reply.region.bottom >= scroll.content_region.bottom - 1
        assert reply.stream.size.height > 20
        engine.hold_after = None
        await idle(pilot, screen)
        await pilot.pause(0.3)
        assert question.region.y == view_top  # nothing moved when the reply ended
        assert "Reply to: a short question" in reply.markdown.source
        await type_and_send(pilot, "next")
        await idle(pilot, screen)
        assert reply.styles.min_height is None  # the next message takes the room
        engine.hold_after = 2  # "Reply to: next" is three tokens
        await pilot.press("ctrl+r")  # regenerate: the new reply below the same question
        await until(pilot, lambda: pane.generating and pane.query(MessageView).last().stream.line_count > 0)
        await pilot.pause(0.3)
        assert list(pane.query(MessageView))[-2].region.y == view_top
        engine.hold_after = None
        await idle(pilot, screen)


async def test_a_reply_ending_in_a_hidden_tab_renders_when_shown_or_when_the_last_reply_ends(tmp_path: Path) -> None:
    """Rendering a finished reply mounts its blocks and lays out the screen: a hidden tab's waits
    while another reply streams, until its tab is shown or the last reply has ended."""
    app, engine = make_app(tmp_path, chat_engine(step_delay=0.005))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        await screen.new_tab()
        hidden, shown = screen.panes()
        for show_it in (True, False):
            engine.hold_after = 8  # the long question's reply waits at 8 tokens, the short one's ends
            assert shown.send("a question long enough that its echoed reply has many more than eight tokens")
            await until(pilot, lambda: len(engine.live_request_ids()) == 1)
            assert hidden.send("hi")
            await until(pilot, lambda: not hidden.generating)
            reply = hidden.session.messages[-1].content
            assert reply == "Reply to: hi" and app.store.count_messages(hidden.session.chat.id) == len(hidden.session.messages)
            view = list(hidden.query(MessageView))[-1]
            assert view.markdown.source == ""  # stored, not rendered yet
            if show_it:
                screen.query_one(TabbedContent).active = hidden.id
                await until(pilot, lambda: view.markdown.source == reply)  # noqa: B023
                screen.query_one(TabbedContent).active = shown.id
                await pilot.pause()
            engine.hold_after = None
            await idle(pilot, screen)
            assert view.markdown.source == reply  # the last reply's end rendered it, if showing it did not
            assert list(shown.query(MessageView))[-1].markdown.source == shown.session.messages[-1].content
