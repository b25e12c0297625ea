"""A streamed reply is painted within a frame budget (one widget: finished blocks rendered as
Markdown, then the unfinished block as plain text) and ends rendered exactly as the same text
rendered at once (a message reopened from the store)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from rich.text import Text
from textual.app import App, ComposeResult
from textual.screen import Screen
from textual.strip import Strip

from app import ASSETS_DIR
from app.ui.reply_stream import (
    GROW_LINES,
    TAIL_LINES,
    ReplyWriter,
    split_finished_blocks,
)
from app.ui.widgets import ChatScroll, MessageView

REPLY = """Here is a plan:

1. Parse the header
2. Map the tensors
   - dequantize Q4_K
   - keep Q8_0
3. Build the model

```python
def load(path):

    return GGUFFile(path)
```

| type | bits |
|------|------|
| Q4_K | 4.5 |
| Q8_0 | 8.5 |

> A quote that
> spans lines.

Done: **bold**, `code` and a [link](https://example.org).
"""

SIZE = (80, 48)


def pieces(text: str, size: int = 3) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


class OneMessage(App):
    CSS_PATH = str(Path(ASSETS_DIR) / "localbatch.tcss")

    def __init__(self, content: str = "") -> None:
        super().__init__()
        self.view = MessageView("assistant", content)

    def compose(self) -> ComposeResult:
        with ChatScroll(classes="messages"):
            yield self.view


async def stream_reply(app: OneMessage, pilot: Any, text: str, flush_every: int = 5) -> ReplyWriter:
    writer = ReplyWriter(app.view.markdown, app.view.stream)
    for i, piece in enumerate(pieces(text)):
        writer.write(piece)
        if i % flush_every == 0:
            await writer.flush()
            await pilot.pause()
    await writer.close()
    await pilot.pause()
    return writer


def test_split_keeps_open_code_fence_in_the_tail() -> None:
    assert split_finished_blocks("a\n\nb") == ("a\n\n", "b")
    assert split_finished_blocks("no blank line yet") == ("", "no blank line yet")
    text = "intro\n\n```\ncode\n\nmore code"
    assert split_finished_blocks(text) == ("intro\n\n", "```\ncode\n\nmore code")
    closed = text + "\n```\n\nafter"
    assert split_finished_blocks(closed) == (closed[: -len("after")], "after")


def painted(app: OneMessage) -> list[str]:
    return [strip.text.rstrip() for strip in app.view.stream._lines]


async def test_finished_blocks_show_as_markdown_and_the_unfinished_one_as_plain_text() -> None:
    app = OneMessage()
    async with app.run_test(size=SIZE) as pilot:
        writer = ReplyWriter(app.view.markdown, app.view.stream)
        writer.write("First **bold** paragraph,\nsecond line.\n\nSecond **unfinished")
        await writer.flush()
        await pilot.pause()
        assert painted(app) == ["First bold paragraph,", "second line.", "", "Second **unfinished"]
        assert app.view.stream.display and app.view.markdown.source == ""  # nothing mounted yet
        await writer.close()
        await pilot.pause()
        assert not app.view.stream.display
        assert app.view.markdown.source == "First **bold** paragraph,\nsecond line.\n\nSecond **unfinished"


async def test_flush_without_new_text_does_not_touch_the_widgets() -> None:
    app = OneMessage()
    async with app.run_test(size=SIZE) as pilot:
        writer = ReplyWriter(app.view.markdown, app.view.stream)
        writer.write("a\n\nb")
        await writer.flush()
        await pilot.pause()
        blocks = list(app.view.markdown.children)
        await writer.flush()
        assert list(app.view.markdown.children) == blocks


@pytest.mark.parametrize("flush_every", [1, 7, 1000])
async def test_streamed_reply_ends_rendered_like_the_whole_text(flush_every: int) -> None:
    static = OneMessage(REPLY)
    async with static.run_test(size=SIZE) as pilot:
        await pilot.pause()
        expected = static.export_screenshot()
    streamed = OneMessage()
    async with streamed.run_test(size=SIZE) as pilot:
        writer = await stream_reply(streamed, pilot, REPLY, flush_every)
        assert writer.text == REPLY
        assert streamed.export_screenshot() == expected


def test_streamed_reply_snapshot(snap_compare: Any) -> None:
    """The final rendering of a streamed reply with a list, code block, table and quote."""
    app = OneMessage()

    async def run(pilot: Any) -> None:
        await stream_reply(app, pilot, REPLY)

    assert snap_compare(app, terminal_size=SIZE, run_before=run)


async def test_the_reply_wraps_at_the_full_width_and_rewraps_on_resize() -> None:
    app = OneMessage()
    async with app.run_test(size=SIZE) as pilot:
        writer = ReplyWriter(app.view.markdown, app.view.stream)
        writer.write("Done.\n\nShort start")
        await writer.flush()
        await pilot.pause()
        for _ in range(30):
            writer.write(" and then some more words")
            await writer.flush()
            await pilot.pause()
        widest = max(len(line) for line in painted(app))
        assert widest >= SIZE[0] - 10
        await pilot.resize_terminal(SIZE[0] // 2, SIZE[1])
        await pilot.pause()
        assert SIZE[0] // 2 - 12 <= max(len(line) for line in painted(app)) <= SIZE[0] // 2
        assert " ".join(" ".join(painted(app)).split()) == " ".join(writer.text.split())


async def test_a_streaming_reply_mounts_nothing_and_lays_out_once_per_few_lines(monkeypatch: Any) -> None:
    """Each layout pass re-arranges the whole screen: the body starts TAIL_LINES high and grows
    GROW_LINES at a time, and no block widget is mounted until the reply ends. Its newest text
    always shows."""
    app = OneMessage()
    async with app.run_test(size=SIZE) as pilot:
        body = app.view.stream
        layouts = []
        refresh = type(body).refresh

        def counting(self: Any, *args: Any, layout: bool = False, **kwargs: Any) -> Any:
            if self is body and layout:
                layouts.append(flushes)  # a resize asks more than once: count flushes that asked
            return refresh(self, *args, layout=layout, **kwargs)

        writer = ReplyWriter(app.view.markdown, body)
        writer.write("Start")
        await writer.flush()
        await pilot.pause()
        flushes = 0
        monkeypatch.setattr(type(body), "refresh", counting)
        i = 0
        while body.line_count < 60:
            writer.write(f" more words, {i}." + ("\n\n" if i % 7 == 6 else ""))  # paragraphs finish now and then
            await writer.flush()
            await pilot.pause()
            flushes += 1
            i += 1
            assert body.line_count <= body.content_region.height <= max(TAIL_LINES, body.line_count + GROW_LINES)
            assert f"{i - 1}." in painted(app)[-1] or not painted(app)[-1]
            assert not app.view.markdown.children
        # 60 lines: ~5 growths, against two or three layouts per finished block before.
        assert 0 < len(set(layouts)) <= (60 - TAIL_LINES) / GROW_LINES + 1, (layouts, flushes)
        await writer.close()
        await pilot.pause()
        assert app.view.markdown.source == writer.text


async def test_a_growing_reply_lays_the_screen_out_once_per_growth(monkeypatch: Any) -> None:
    """Textual follows a layout that resized a widget with a second one (its `virtual_size` asks
    for it) that moves nothing: the chat's widgets take their new size in the first."""
    app = OneMessage("An earlier reply.")
    async with app.run_test(size=SIZE) as pilot:
        body = app.view.stream
        body.display = True
        await pilot.pause()
        layouts = 0
        refresh_layout = Screen._refresh_layout

        def counting(self: Screen, *args: Any, **kwargs: Any) -> None:
            nonlocal layouts
            layouts += 1
            refresh_layout(self, *args, **kwargs)

        monkeypatch.setattr(Screen, "_refresh_layout", counting)
        writer = ReplyWriter(app.view.markdown, body)
        growths = 0
        for i in range(60):
            height = body.size.height
            layouts = 0
            writer.write(f"Line {i} of a reply that outgrows the screen.\n")
            await writer.flush()
            await pilot.pause()
            await pilot.pause()
            grew = body.size.height != height
            growths += grew
            assert layouts == grew, (i, layouts, height, body.size.height)
        assert growths >= 2
        scroll = app.query_one(ChatScroll)
        assert scroll.max_scroll_y > 0, (scroll.virtual_size, scroll.size, body.size, body.line_count)


async def test_a_flush_repaints_only_the_lines_that_changed(monkeypatch: Any) -> None:
    """Words added to a long paragraph re-wrap its last lines only: the compositor's work per
    frame grows with the lines it redraws, so the lines above are not marked."""
    app = OneMessage()
    async with app.run_test(size=SIZE) as pilot:
        body = app.view.stream
        writer = ReplyWriter(app.view.markdown, body)
        writer.write("word " * 100)
        await writer.flush()
        await pilot.pause()
        assert body.line_count > 5
        regions = []
        monkeypatch.setattr(type(body), "refresh", lambda self, *args, **kwargs: regions.append(args))
        writer.write("and more words")
        await writer.flush()
        [(region,)] = regions
        assert region.y >= body.line_count - 2 and region.bottom == body.line_count


CODE_REPLY = """Merging:

```python
def merge(a: list[int], b: list[int]) -> list[int]:
\t\"\"\"Merge two sorted lists into one sorted list, keeping every element of both inputs in order.\"\"\"

    out = []


    while a and b:
        out.append((a if a[0] <= b[0] else b).pop(0))
    return out + a + b
```

Done.
"""


async def test_an_unfinished_block_paints_as_if_rendered_whole_at_every_flush() -> None:
    """The unfinished block (here a code block, until its fence closes) renders its complete lines
    once; at every flush its lines equal the whole tail rendered at once."""
    app = OneMessage()
    async with app.run_test(size=(60, 48)) as pilot:
        body = app.view.stream
        writer = ReplyWriter(app.view.markdown, body)
        for size in (1, 3, 7):
            for piece in pieces(CODE_REPLY, size):
                writer.write(piece)
                await writer.flush()
                whole = body._render(Text(body._tail.rstrip("\n")), body._width) if body._tail.strip() else []
                gap = [Strip.blank(body._width, body.rich_style)] if body._block_lines and whole else []
                assert body._lines == body._block_lines + gap + whole
            await pilot.pause()
            writer = ReplyWriter(app.view.markdown, body)
            body.clear()


async def test_the_body_style_is_kept_until_the_styles_change() -> None:
    """The body's style walks the DOM, so it is kept; a new theme (every widget restyled) or a class
    that changes the colours must reach the blank lines below the text."""
    app = OneMessage()
    async with app.run_test(size=SIZE) as pilot:
        body = app.view.stream
        await pilot.pause()
        assert body.base_style == body.rich_style
        before = body.base_style
        app.theme = "textual-light" if app.theme != "textual-light" else "nord"
        await pilot.pause()
        assert body.base_style == body.rich_style != before
        assert body.line_count == 0 and list(body.render_line(0))[0].style == body.rich_style
