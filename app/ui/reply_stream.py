"""Painting a streaming reply within a frame budget.

Re-parsing Markdown on every engine step held the UI thread (and so the GIL) long enough to halve
the engine's speed inside the app. Here the deltas only land in a buffer; a flush, at most
`FRAME_HZ` times a second and only while the tab is shown, moves finished Markdown blocks into the
Markdown widget (each block parsed once; at most once a second, as each move costs a layout) and
shows the rest as plain text, which costs no parse. A hidden tab keeps buffering and paints once
when it is shown again."""

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
# Blank lines a streaming reply's plain-text tail keeps below its text, so that most lines it
# gains need no layout pass (a third of the UI thread's time at one tab was layouts; with blocks
# waiting up to BLOCK_MOVE_S in the tail, it grows by a paragraph or two between moves).
TAIL_SPARE_LINES = 8
# Finished blocks move into the Markdown widget at most this often: each move mounts block widgets,
# which costs a layout of the whole screen (docs/benchmarks.md), and a fast model finishes several
# paragraphs a second. Until then they stay in the plain-text tail.
BLOCK_MOVE_S = 1.0
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
        blocks, tail = split_finished_blocks(text[self._painted :])
        now = self._clock()
        if blocks and now - self._moved_at >= BLOCK_MOVE_S:
            self._painted += len(blocks)
            self._moved_at = now
            await self._markdown.append(blocks)
        else:
            tail = blocks + tail
        self._show_tail(tail)

    async def close(self) -> None:
        """The reply ended: the rest goes to the Markdown widget, so the final rendering is the
        same Markdown a finished message gets."""
        rest = self.text[self._painted :]
        self._painted += len(rest)
        self._dirty = False
        self._show_tail("")
        if rest:
            await self._markdown.append(rest)

    def _show_tail(self, tail: str) -> None:
        widget = self._tail
        if not tail:
            widget.display = False
            return
        # A layout pass re-arranges the whole screen (the app's main cost while streaming): the
        # tail keeps up to TAIL_SPARE_LINES blank lines below its text to grow into, and asks for
        # a layout only when it outgrows them (or a finished block left it far too tall).
        region = widget.content_region
        if not widget.display or region.width <= 0:
            widget.styles.height = "auto"  # not laid out yet: its first showing needs a size
            widget.update(tail)
            widget.display = True
            return
        needed = Content(tail).get_height(widget.styles, region.width)
        if needed <= region.height <= needed + TAIL_SPARE_LINES:
            widget.update(tail, layout=False)
            return
        widget.styles.height = needed + TAIL_SPARE_LINES
        widget.update(tail, layout=True)
