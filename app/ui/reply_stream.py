"""Painting a streaming reply within a frame budget.

Re-parsing Markdown on every engine step held the UI thread (and so the GIL) long enough to halve
the engine's speed inside the app. Here the deltas only land in a buffer; a flush, at most
`FRAME_HZ` times a second and only while the tab is shown, shows the newest text as plain text in
a tail of `TAIL_LINES` lines, which costs no parse and, while the text fits, no layout. Finished
Markdown blocks move into the Markdown widget (each block parsed once) when the tail would
overflow, or `BLOCK_MOVE_S` after the last move: each move costs a layout of the screen. A hidden
tab keeps buffering and paints once when it is shown again."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from textual.content import Content
from textual.widgets import Markdown, Static

# Repaints per second while replies stream (the shown tab's reply; the panels every few frames).
# Each paint costs the UI thread ~2-4 ms of Textual compositing whatever it adds, and on a 2-core
# machine every such millisecond holds the GIL the engine's step thread needs between torch ops:
# with 4 tabs streaming the UI thread used 7.4% of a core at 10 Hz, 5.5% at 5 Hz
# (benchmarks/ui_cost.py, paced fake engine). 5 Hz still reads as a steady stream.
FRAME_HZ = 5
# How long the engine may hold a reply's deltas before waking the UI with them: half a frame, so a
# paint shows text at most that much staler, and the UI thread wakes ~10 times a second instead
# of at every engine step (each wake-up holds the GIL the step thread needs between torch ops).
DELTA_MAX_DELAY_S = 0.5 / FRAME_HZ
# The plain-text tail's height while a reply streams: new text fills it without a layout pass (three
# quarters of the UI thread's time while streaming were layouts, ~15 ms of CPU each here:
# docs/benchmarks.md). Only a single unfinished block taller than this makes it grow, with
# TAIL_SPARE_LINES more to grow into.
TAIL_LINES = 12
TAIL_SPARE_LINES = 8
# Finished blocks wait in the tail until it would overflow, or at most this long after the last
# move (a slow model's formatting still catches up): each move mounts block widgets, a layout.
BLOCK_MOVE_S = 2.0
_FENCE = re.compile(r"^ {0,3}(```|~~~)", re.MULTILINE)


def split_finished_blocks(text: str) -> tuple[str, str]:
    """Split `text` into (finished blocks, unfinished tail) at the last blank line that is not
    inside a code fence: Markdown can no longer change how anything before that line renders,
    except a list or quote continued after the blank line, which the next append re-parses."""
    end = len(text)
    while (cut := text.rfind("\n\n", 0, end)) >= 0:
        head = text[: cut + 2]
        if len(_FENCE.findall(head)) % 2 == 0:
            return head, text[cut + 2 :]
        end = cut
    return "", text


class ReplyWriter:
    """Buffers one reply's deltas for a Markdown body plus a plain-text tail (see the module doc)."""

    def __init__(self, markdown: Markdown, tail: Static, clock: Callable[[], float] = time.monotonic) -> None:
        self._markdown = markdown
        self._tail = tail
        self._clock = clock
        self._moved_at = float("-inf")
        self._parts: list[str] = []
        self._painted = 0  # characters of the reply already handed to the Markdown widget
        self._dirty = False

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def write(self, text: str) -> None:
        if text:
            self._parts.append(text)
            self._dirty = True

    async def flush(self) -> None:
        """Paint what arrived since the last flush."""
        if not self._dirty:
            return
        self._dirty = False
        text = self.text
        self._parts = [text]
        pending = text[self._painted :]
        blocks, tail = split_finished_blocks(pending)
        needed = self._lines(pending) if self._laid_out() else None  # wrapped once a flush
        now = self._clock()
        overflows = needed is not None and needed > self._tail.content_region.height
        if blocks and (now - self._moved_at >= BLOCK_MOVE_S or overflows):
            self._painted += len(blocks)
            self._moved_at = now
            await self._markdown.append(blocks)
            pending, needed = tail, None
        self._show_tail(pending, needed)

    async def close(self) -> None:
        """The reply ended: the rest goes to the Markdown widget, so the final rendering is the
        same Markdown a finished message gets."""
        rest = self.text[self._painted :]
        self._painted += len(rest)
        self._dirty = False
        self._tail.display = False
        self._tail.update("")
        if rest:
            await self._markdown.append(rest)

    def _lines(self, text: str) -> int:
        return Content(text).get_height(self._tail.styles, self._tail.content_region.width)

    def _laid_out(self) -> bool:
        return self._tail.display and self._tail.content_region.width > 0

    def _show_tail(self, tail: str, needed: int | None = None) -> None:
        """`needed`: the tail's wrapped height, when the caller has it already."""
        # A layout pass re-arranges the whole screen (the app's main cost while streaming): the
        # tail keeps its height while the text fits (blank lines below it until then) and asks
        # for a layout only when a single block outgrows it.
        widget = self._tail
        region = widget.content_region
        if not self._laid_out():  # its first showing: a size to start with
            widget.styles.height = "auto"
            widget.styles.min_height = TAIL_LINES
            widget.update(tail)
            widget.display = True
            return
        if needed is None:
            needed = self._lines(tail)
        if needed <= region.height:
            widget.update(tail, layout=False)
            return
        widget.styles.height = needed + TAIL_SPARE_LINES
        widget.update(tail, layout=True)
