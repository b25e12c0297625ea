"""A streamed reply is painted within a frame budget (finished Markdown blocks + a plain tail) and
ends rendered exactly as the same text rendered at once (a message reopened from the store)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from textual.app import App, ComposeResult
from textual.containers import VerticalScroll
from textual.content import Content

from app import ASSETS_DIR
from app.ui.reply_stream import (
    BLOCK_MOVE_S,
    TAIL_LINES,
    TAIL_SPARE_LINES,
    ReplyWriter,
    split_finished_blocks,
)
from app.ui.widgets import MessageView

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
        with VerticalScroll(classes="messages"):
            yield self.view


async def stream_reply(app: OneMessage, pilot: Any, text: str, flush_every: int = 5) -> ReplyWriter:
    writer = ReplyWriter(app.view.markdown, app.view.tail)
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


async def test_tail_shows_the_unfinished_block_as_plain_text() -> None:
    app = OneMessage()
    async with app.run_test(size=SIZE) as pilot:
        writer = ReplyWriter(app.view.markdown, app.view.tail)
        writer.write("First paragraph.\n\nSecond **unfinished")
        await writer.flush()
        await pilot.pause()
        assert app.view.markdown.source == "First paragraph.\n\n"
        assert app.view.tail.display and "Second **unfinished" in str(app.view.tail.render())
        await writer.close()
        await pilot.pause()
        assert not app.view.tail.display
        assert app.view.markdown.source == "First paragraph.\n\nSecond **unfinished"


async def test_flush_without_new_text_does_not_touch_the_widgets() -> None:
    app = OneMessage()
    async with app.run_test(size=SIZE) as pilot:
        writer = ReplyWriter(app.view.markdown, app.view.tail)
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


async def test_tail_wraps_at_the_full_width_as_it_grows() -> None:
    app = OneMessage()
    async with app.run_test(size=SIZE) as pilot:
        writer = ReplyWriter(app.view.markdown, app.view.tail)
        writer.write("Short start")
        await writer.flush()
        await pilot.pause()
        for _ in range(30):
            writer.write(" and then some more words")
            await writer.flush()
            await pilot.pause()
        assert app.view.tail.size.width >= SIZE[0] - 4


async def test_a_growing_tail_asks_for_a_layout_once_per_few_lines(monkeypatch: Any) -> None:
    """Each layout pass re-arranges the whole screen: the tail starts TAIL_LINES high, then keeps
    spare lines to grow into and asks for one only when it outgrows them. Its text is always whole
    and visible."""
    app = OneMessage()
    async with app.run_test(size=SIZE) as pilot:
        tail = app.view.tail
        layouts = []
        refresh = type(tail).refresh

        def counting(self, *args: Any, layout: bool = False, **kwargs: Any) -> Any:
            if self is tail and layout:
                layouts.append(flushes)  # a resize asks more than once: count flushes that asked
            return refresh(self, *args, layout=layout, **kwargs)

        writer = ReplyWriter(app.view.markdown, tail)
        writer.write("Start")
        await writer.flush()
        await pilot.pause()
        flushes = 0
        monkeypatch.setattr(type(tail), "refresh", counting)
        while tail.content_region.height < 30:
            writer.write(" a few more words")  # one line every ~4 flushes at this width
            await writer.flush()
            await pilot.pause()
            flushes += 1
            lines = Content(str(tail.render())).get_height(tail.styles, tail.content_region.width)
            assert lines <= tail.content_region.height <= max(TAIL_LINES, lines + TAIL_SPARE_LINES)
        # 30 lines at one per ~4 flushes: without the reserve ~30 flushes would ask, here ~3.
        assert 0 < len(set(layouts)) <= (30 - TAIL_LINES) / TAIL_SPARE_LINES + 1, (layouts, flushes)


async def test_finished_blocks_move_at_most_once_per_block_move_period() -> None:
    """Each move into the Markdown widget mounts widgets (a layout of the screen): blocks that
    finish sooner wait in the plain-text tail, and nothing is lost or shown twice meanwhile."""
    app = OneMessage()
    async with app.run_test(size=SIZE) as pilot:
        now = [100.0]
        writer = ReplyWriter(app.view.markdown, app.view.tail, clock=lambda: now[0])
        writer.write("One.\n\nTwo")
        await writer.flush()
        await pilot.pause()
        assert app.view.markdown.source == "One.\n\n"
        writer.write(".\n\nThree")
        now[0] += BLOCK_MOVE_S / 2
        await writer.flush()
        await pilot.pause()
        assert app.view.markdown.source == "One.\n\n"  # too soon: "Two." waits in the tail
        assert "Two.\n\nThree" in str(app.view.tail.render())
        now[0] += BLOCK_MOVE_S
        writer.write(" more")
        await writer.flush()
        await pilot.pause()
        assert app.view.markdown.source == "One.\n\nTwo.\n\n"
        assert "Two." not in str(app.view.tail.render()) and "Three more" in str(app.view.tail.render())


async def test_blocks_move_early_when_the_tail_would_overflow() -> None:
    """A fast model finishes paragraphs faster than BLOCK_MOVE_S: they wait in the tail while it
    holds them, then move together as it fills; the tail's height never changes meanwhile."""
    app = OneMessage()
    async with app.run_test(size=SIZE) as pilot:
        writer = ReplyWriter(app.view.markdown, app.view.tail, clock=lambda: 100.0)  # time stands still
        writer.write("Start")
        await writer.flush()
        await pilot.pause()
        height = app.view.tail.content_region.height
        assert height == TAIL_LINES
        for i in range(3 * TAIL_LINES):
            writer.write(f".\n\nParagraph {i}")
            await writer.flush()
            await pilot.pause()
            assert app.view.tail.content_region.height == height
            assert str(app.view.tail.render()).endswith(f"Paragraph {i}")  # the newest text shows
        moved = app.view.markdown.source
        assert moved.startswith("Start.\n\nParagraph 0.\n\n") and "Paragraph 20." in moved
        await writer.close()
        await pilot.pause()
        assert app.view.markdown.source == writer.text
