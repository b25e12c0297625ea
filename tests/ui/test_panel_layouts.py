"""Panels and a starting reply change no widget's height while replies stream: each change of
height is a layout of the whole screen (tens of milliseconds of the UI thread with a long chat).
Nor does a reply's start or end animate the tabs' underline."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import App, ComposeResult
from textual.containers import Vertical
from textual.widgets import TabbedContent, TabPane
from textual.widgets._tabs import Underline

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


async def test_a_relabel_never_animates_the_tab_underline(monkeypatch: Any) -> None:
    """A reply's start and end swap a blank for a dot, and a chat's first message gives it a
    title: sliding the underline would repaint the screen ~17 times in 0.3 s. A title of another
    width puts the underline under the tab at once."""
    animated: list[str] = []
    monkeypatch.setattr(Underline, "animate", lambda self, attribute, *a, **k: animated.append(attribute))
    app = TwoTabs()
    async with app.run_test(size=(60, 10)) as pilot:
        tab = app.query_one(TabbedContent).get_tab("one")
        underline = app.query_one(Underline)
        await pilot.pause()
        animated.clear()  # the tabs' own start
        for label in ("Chat 1  ", "Chat 1 ●", "A longer title  ", "A longer title ●", "Short"):
            relabel(tab, Text(label))  # as chat tabs are labelled: idle, busy, titled
            await pilot.pause()
            assert tab.label.plain == label
            assert (underline.highlight_start, underline.highlight_end) == tab.region.shrink(tab.styles.gutter).column_span
        assert animated == []
