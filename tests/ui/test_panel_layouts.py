"""Panels and a starting reply change no widget's height while replies stream: each change of
height is a layout of the whole screen (tens of milliseconds of the UI thread with a long chat).
Nor does a reply's start or end animate the tabs' underline."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import App, ComposeResult
from textual.containers import Vertical
from textual.widgets import TabbedContent, TabPane, Tabs

from app.ui.panels import PanelDigits, PanelText
from app.ui.screen import relabel
from app.ui.widgets import MessageView


class Panels(App):
    def compose(self) -> ComposeResult:
        with Vertical():
            yield PanelText(id="text")
            yield PanelDigits("0.0", id="digits")
            yield MessageView("assistant", streaming=True)


def count_layouts(monkeypatch: Any, widget: Any) -> list[int]:
    layouts: list[int] = []
    refresh = type(widget).refresh

    def counting(self: Any, *args: Any, layout: bool = False, **kwargs: Any) -> Any:
        if self is widget and layout:
            layouts.append(1)
        return refresh(self, *args, layout=layout, **kwargs)

    monkeypatch.setattr(type(widget), "refresh", counting)
    return layouts


async def test_panel_text_keeps_its_height_while_busy_and_shrinks_when_idle(monkeypatch: Any) -> None:
    app = Panels()
    async with app.run_test(size=(60, 30)) as pilot:
        text = app.query_one("#text", PanelText)
        text.show(Text("a\nb\nc"))
        await pilot.pause()
        assert text.size.height == 3
        layouts = count_layouts(monkeypatch, text)
        text.show(Text("a\nb"), keep_height=True)  # a reply ended, others still run
        text.show(Text("a\nb\nC"), keep_height=True)  # the next one started
        await pilot.pause()
        assert layouts == [] and text.size.height == 3
        text.show(Text("a"))  # idle: fit the text
        await pilot.pause()
        assert layouts and text.size.height == 1


async def test_digits_of_another_width_repaint_without_a_layout(monkeypatch: Any) -> None:
    app = Panels()
    async with app.run_test(size=(60, 30)) as pilot:
        digits = app.query_one(PanelDigits)
        layouts = count_layouts(monkeypatch, digits)
        digits.update(" 123")
        await pilot.pause()
        assert digits.value == " 123" and layouts == []


async def test_a_streaming_reply_shows_its_body_from_the_start() -> None:
    app = Panels()
    async with app.run_test(size=(60, 30)) as pilot:
        await pilot.pause()
        view = app.query_one(MessageView)
        assert view.stream.display and view.stream.size.height > 0


class TwoTabs(App):
    def compose(self) -> ComposeResult:
        with TabbedContent():
            yield TabPane("Chat 1", id="one")
            yield TabPane("Chat 2", id="two")


async def test_a_relabel_of_the_same_width_leaves_the_tab_underline_alone(monkeypatch: Any) -> None:
    """A reply's start and end swap a blank for a dot: moving the underline would animate it for
    0.3 s (~17 repaints of the screen). A new title of another width still moves it."""
    moves: list[int] = []
    highlight = Tabs._highlight_active
    monkeypatch.setattr(Tabs, "_highlight_active", lambda self, *a, **k: (moves.append(1), highlight(self, *a, **k))[1])
    app = TwoTabs()
    async with app.run_test(size=(60, 10)) as pilot:
        tab = app.query_one(TabbedContent).get_tab("one")
        relabel(tab, Text("Chat 1  "))  # as a chat tab is labelled when idle
        await pilot.pause()
        moves.clear()
        relabel(tab, Text("Chat 1 ●"))
        await pilot.pause()
        assert tab.label.plain == "Chat 1 ●" and moves == []
        relabel(tab, Text("A longer title"))
        await pilot.pause()
        assert tab.label.plain == "A longer title" and moves
