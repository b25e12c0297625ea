"""Painting a streaming reply within a frame budget.

Re-parsing Markdown on every engine step held the UI thread (and so the GIL) long enough to slow
the engine badly inside the app, and on two cores every millisecond the UI thread computes stalls
one of the engine's threads. Here the deltas only land in a buffer; a flush, at most `FRAME_HZ`
times a second and only while the tab is shown, paints the new text into `StreamingBody`: one
widget that mounts nothing. Finished Markdown blocks are rendered once (Rich's Markdown renderer)
and kept as lines; the unfinished block below them is plain text. Every change of the body's
height lays out the screen (costly for the UI thread, more so as the chat grows): it starts as
high as the caller makes room for (the chat fills the view below the question) and grows
`GROW_LINES` at a time, where mounting Textual's Markdown blocks cost two or three layouts per
finished block. When the reply ends its whole text goes to the Markdown widget once:
the final rendering is the same Markdown a finished or reopened message gets. A hidden tab keeps
buffering and paints once when it is shown again; a reply that ends in it while others stream is
rendered then, or once the last of them ends (`FinalRenders`)."""

from __future__ import annotations

import re
from functools import cache

from markdown_it import MarkdownIt
from rich.markdown import Markdown as RichMarkdown
from rich.style import Style
from rich.text import Text
from textual import events
from textual.geometry import Region
from textual.strip import Strip
from textual.widget import Widget
from textual.widgets import Markdown

from app.ui.layout_once import LaidOutOnce

# Repaints per second while replies stream (the shown tab's reply; the panels every few frames).
# Each paint costs the UI thread Textual's compositing whatever it adds, and on a 2-core machine
# every such millisecond holds the GIL the engine's step thread needs between torch ops: fewer
# paints cost the engine less (docs/tuning.md), and 5 Hz still reads as a steady stream.
FRAME_HZ = 5
# How long the engine may hold a reply's deltas before waking the UI with them: half a frame, so a
# paint shows text at most that much staler, and the UI thread wakes ~10 times a second instead
# of at every engine step (each wake-up holds the GIL the step thread needs between torch ops).
DELTA_MAX_DELAY_S = 0.5 / FRAME_HZ
# The streaming body's least height, and how much it grows once the text outgrows it: each
# growth is one layout of the screen, and the blank lines below the text until then are what it
# costs.
TAIL_LINES = 12
GROW_LINES = 10
_FENCE = re.compile(r"^ {0,3}(```|~~~)", re.MULTILINE)


def chat_markdown_parser() -> MarkdownIt:
    """Textual's parser, but a single newline stays a line break: model replies (poems, lists
    without blank lines, code-like text) are written line by line, as chat UIs show them."""
    md = MarkdownIt("gfm-like")

    def hard_breaks(state) -> None:  # noqa: ANN001 - markdown-it's StateCore
        for block in state.tokens:
            for token in block.children or []:
                if token.type == "softbreak":
                    token.type = "hardbreak"

    md.core.ruler.push("hard_breaks", hard_breaks)
    return md


@cache
def _stream_parser() -> MarkdownIt:
    """One parser for every streaming body: each message view has one, mostly never shown."""
    return chat_markdown_parser()


def split_finished_blocks(text: str) -> tuple[str, str]:
    """Split `text` into (finished blocks, unfinished tail) at the last blank line that is not
    inside a code fence: Markdown can no longer change how anything before that line renders,
    except a list or quote continued after the blank line (the final rendering joins them)."""
    end = len(text)
    while (cut := text.rfind("\n\n", 0, end)) >= 0:
        head = text[: cut + 2]
        if len(_FENCE.findall(head)) % 2 == 0:
            return head, text[cut + 2 :]
        end = cut
    return "", text


class StreamingBody(LaidOutOnce, Widget):
    """A reply while it streams: finished blocks rendered as Markdown once and kept as lines, then
    the unfinished block as plain text, in a height that grows `GROW_LINES` at a time."""

    DEFAULT_CSS = """
    StreamingBody {
        width: 1fr;  /* not auto: the reply wraps at the message's full width from its first words */
        padding: 0 1;
    }
    """

    def __init__(self, height: int = TAIL_LINES, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self._batches: list[str] = []  # finished blocks, as painted (one Markdown rendering each)
        self._tail = ""
        self._status = ""  # a line under the text (a call being written)
        self._width = 0  # what the lines below were rendered at; 0: not yet
        self._block_lines: list[Strip] = []
        self._tail_done = ""  # the tail's complete lines, as painted below
        self._tail_done_lines: list[Strip] = []
        self._lines: list[Strip] = []  # block lines, a blank line, the tail's lines
        self._style: Style | None = None  # `rich_style`, until the styles change
        self._initial_height = self._height = max(height, TAIL_LINES)
        self.styles.height = self._height

    @property
    def text(self) -> str:
        return "".join(self._batches) + self._tail

    @property
    def status(self) -> str:
        return self._status

    @property
    def line_count(self) -> int:
        """Lines of text painted (the rest of the height is blank until the text reaches it)."""
        return len(self._lines)

    def show(self, blocks: str, tail: str, status: str = "") -> None:
        """Append finished Markdown `blocks` (may be empty) and replace the unfinished `tail`;
        `status` is a line under them saying what the model is doing besides text ("": none)."""
        old = self._lines
        if blocks:
            self._batches.append(blocks)
            if self._width:
                self._block_lines += self._render_blocks(blocks, self._width, after=self._block_lines)
        self._tail = tail
        self._status = status
        self._assemble()
        self._fit()
        if self._width:  # only the lines that changed: the compositor redraws what they cover
            first = _first_difference(old, self._lines)
            if (changed := max(len(old), len(self._lines)) - first) > 0:
                self.refresh(Region(0, first, self._width, changed))

    def clear(self) -> None:
        self._batches, self._tail, self._status = [], "", ""
        self._block_lines, self._lines = [], []
        self._tail_done, self._tail_done_lines = "", []
        self._height = self._initial_height
        self.styles.height = self._height

    def render_line(self, y: int) -> Strip:
        if y < len(self._lines):
            return self._lines[y]
        return Strip.blank(self.size.width, self.base_style)

    @property
    def base_style(self) -> Style:
        """`rich_style`, kept until the styles change: it walks the DOM (costly in a chat tab), and
        each frame's rendering and each blank line of a repaint after a layout ask for it."""
        if self._style is None:
            self._style = self.rich_style
        return self._style

    def notify_style_update(self) -> None:
        self._style = None
        super().notify_style_update()

    def on_resize(self, event: events.Resize) -> None:
        width = self.size.width
        if width and width != self._width:  # first laid out, or the terminal resized: re-wrap
            self._width = width
            self._block_lines = []
            self._tail_done, self._tail_done_lines = "", []
            for batch in self._batches:
                self._block_lines += self._render_blocks(batch, width, after=self._block_lines)
            self._assemble()
            self._fit()
            self.refresh()

    def _assemble(self) -> None:
        if not self._width:
            return
        tail = self._render_tail() if self._tail.strip() else []
        gap = [Strip.blank(self._width, self.base_style)] if self._block_lines and tail else []
        self._lines = self._block_lines + gap + tail
        if self._status:
            status = self._render(Text(self._status, style="dim italic"), self._width)
            self._lines = self._lines + [Strip.blank(self._width, self.base_style)] * bool(self._lines) + status

    def _render_tail(self) -> list[Strip]:
        """The unfinished block as plain text. Each of its lines wraps alone, and text is only ever
        added, so its complete lines are rendered once: a code block is one unfinished block until
        its fence closes, and rendering all of it at every frame cost more as it grew."""
        text = self._tail.rstrip("\n")
        if not text.startswith(self._tail_done):  # blocks finished: this is a new tail
            self._tail_done, self._tail_done_lines = "", []
        cut = text.rfind("\n") + 1
        if cut > len(self._tail_done):
            self._tail_done_lines += self._render(Text(text[len(self._tail_done) : cut - 1]), self._width)
            self._tail_done = text[:cut]
        return self._tail_done_lines + self._render(Text(text[cut:]), self._width)

    def _fit(self) -> None:
        """Grow when the text outgrows the height (one layout of the screen), never shrink."""
        if len(self._lines) > self._height:
            self._height = len(self._lines) + GROW_LINES
            self.styles.height = self._height

    def _render_blocks(self, blocks: str, width: int, after: list[Strip]) -> list[Strip]:
        markdown = RichMarkdown("", code_theme="monokai")
        markdown.parsed = _stream_parser().parse(blocks)  # the chat parser: a newline is a line break
        lines = self._render(markdown, width)
        return ([Strip.blank(width, self.base_style)] if after and lines else []) + lines

    def _render(self, renderable: RichMarkdown | Text, width: int) -> list[Strip]:
        console, base = self.app.console, self.base_style  # the body's colours under Rich's styles
        options = console.options.update(width=width, height=None, highlight=False)
        lines = console.render_lines(renderable, options, pad=False)
        return [Strip(line).apply_style(base).simplify() for line in lines]


def _first_difference(old: list[Strip], new: list[Strip]) -> int:
    """The first line that differs: a paragraph that gains words re-wraps only its last lines, and
    the compositor's cost grows with the lines it redraws."""
    for y, (before, after) in enumerate(zip(old, new)):
        if before is not after and before != after:
            return y
    return min(len(old), len(new))


class ReplyWriter:
    """Buffers one reply's deltas and paints them into a `StreamingBody` (see the module doc); at
    the end the whole text goes to the message's Markdown widget."""

    def __init__(self, markdown: Markdown, body: StreamingBody) -> None:
        self._markdown = markdown
        self._body = body
        self._parts: list[str] = []
        self._painted = 0  # characters of the reply painted as finished blocks
        self._dirty = False
        self._status = ""  # what the model is doing that is not text (a call being written)

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def write(self, text: str) -> None:
        if text:
            self._parts.append(text)
            self._dirty = True

    def calling(self, name: str) -> None:
        """The model began a call to `name`: said under the text while the call is written."""
        self._status = f"writing a call to {name}…"
        self._dirty = True

    async def flush(self) -> None:
        """Paint what arrived since the last flush."""
        if not self._dirty:
            return
        self._dirty = False
        text = self.text
        self._parts = [text]
        blocks, tail = split_finished_blocks(text[self._painted :])
        self._painted += len(blocks)
        if not self._body.display:
            self._body.display = True
        self._body.show(blocks, tail, self._status)

    async def close(self, render: bool = True) -> str:
        """The reply ended: its whole text goes to the Markdown widget (unless not `render`: the
        caller renders it later), so the final rendering is the same Markdown a finished message
        gets. Returns the text."""
        self._dirty = False
        self._body.display = False
        self._body.clear()
        if (text := self.text) and render:
            await self._markdown.update(text)
        return text


class FinalRenders:
    """The final Markdown renders of the app's replies. Rendering a reply mounts a widget per block
    and lays out the screen: tens of ms of the UI thread that the step thread waits for, and the
    replies still streaming meanwhile read their last tokens late. So a reply that ends in a
    hidden tab while others stream is rendered when its tab is shown or the last of them ends."""

    def __init__(self) -> None:
        self._streaming = 0
        self._waiting: dict[str, list[tuple[Markdown, str]]] = {}  # tab id -> (widget, final text)

    def started(self) -> None:
        self._streaming += 1

    async def ended(self, tab: str, writer: ReplyWriter, markdown: Markdown, shown: bool) -> str:
        """Close `writer` (its reply ended in `tab`) and render its text now or later; returns the text."""
        self._streaming -= 1
        if not shown and self._streaming > 0:
            text = await writer.close(render=False)
            if text:
                self._waiting.setdefault(tab, []).append((markdown, text))
            return text
        text = await writer.close()
        if self._streaming == 0:
            for waiting in list(self._waiting):
                await self.shown(waiting)
        return text

    async def shown(self, tab: str) -> None:
        """`tab` is shown: render what ended in it while it was hidden."""
        for markdown, text in self._waiting.pop(tab, []):
            if markdown.is_attached:  # not a view removed meanwhile (a failed reply, a closed tab)
                await markdown.update(text)
