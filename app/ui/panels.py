"""The side panels: KV-cache budget (who holds which blocks) and throughput (tokens/s now and over
the last minute, batch size, step time, per-tab rates). Both are redrawn from one `EngineStats`
snapshot per poll; the rendering is plain functions of that snapshot so tests can check it."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Digits, Label, Sparkline, Static

from app.engine.types.outputs import DiskTierStats, EngineStats
from app.ui.format import fmt_bytes, fmt_int, fmt_rate, fmt_seconds

API_COLOR = "grey70"
CACHED_COLOR = "grey39"
FREE_COLOR = "grey23"


@dataclass(frozen=True)
class Owner:
    """Who a request id belongs to: a chat tab (key, label, color) — anything else is an API request."""

    key: str
    label: str
    color: str


@dataclass(frozen=True)
class KVSegment:
    label: str
    color: str
    blocks: int
    requests: int


@dataclass(frozen=True)
class TabRate:
    """One row of the per-tab rates table."""

    label: str
    color: str
    tokens_per_s: float | None
    ttft_s: float | None
    status: str  # "idle" | "waiting" | "prefill" | "decode"


SHARED_COLOR = "magenta"


def kv_segments(stats: EngineStats, owners: dict[str, Owner], tabs: Sequence[Owner] = ()) -> list[KVSegment]:
    """Blocks held per tab (`tabs` first, in their order, holding blocks or not; then other holders
    in order of appearance), then one segment for all API requests, then the blocks two or more
    requests hold (a forked chat and its parent, n > 1 choices) once, as "shared by N": counted
    per holder they would add up to more than the pool uses."""
    blocks: Counter[Owner | None] = Counter()
    requests: Counter[Owner | None] = Counter({tab: 0 for tab in tabs})
    sharers: set[Owner | str] = set()
    for req in stats.requests:
        owner = owners.get(req.request_id)  # None: an API request
        blocks[owner] += req.num_blocks - req.num_shared_blocks
        requests[owner] += 1
        if req.num_shared_blocks:
            sharers.add(owner or req.request_id)
    segments = [KVSegment(o.label, o.color, blocks[o], n) for o, n in requests.items() if o is not None]
    if requests[None]:
        segments.append(KVSegment("API", API_COLOR, blocks[None], requests[None]))
    if stats.num_blocks_shared:
        tabs = sum(isinstance(s, Owner) for s in sharers)
        who = f"{tabs} tabs" if tabs == len(sharers) else f"{len(sharers)} requests"
        segments.append(KVSegment(f"shared by {who}", SHARED_COLOR, stats.num_blocks_shared, len(sharers)))
    return segments


def bar_cells(counts: list[int], total: int, width: int) -> list[int]:
    """Split `width` cells proportionally to `counts` out of `total` (largest remainder), giving
    every non-zero count at least one cell so a small tab still shows up."""
    if total <= 0 or width <= 0:
        return [0] * len(counts)
    exact = [c * width / total for c in counts]
    cells = [int(x) for x in exact]
    spare = width - sum(cells)
    order = sorted(range(len(counts)), key=lambda i: exact[i] - cells[i], reverse=True)
    for i in order:
        if spare <= 0:
            break
        if exact[i] > cells[i]:
            cells[i] += 1
            spare -= 1
    for i, c in enumerate(counts):
        if c > 0 and cells[i] == 0:
            donor = max(range(len(cells)), key=lambda j: cells[j])
            if cells[donor] > 1:
                cells[donor] -= 1
                cells[i] = 1
    return cells


def render_kv_bar(stats: EngineStats, segments: list[KVSegment], width: int) -> Text:
    total = stats.num_blocks_total
    attributed = sum(s.blocks for s in segments)
    # Blocks the snapshot counts as used but no listed request holds (e.g. just finished).
    other = max(stats.num_blocks_used - attributed, 0)
    used_free = max(total - stats.num_blocks_used, 0)
    cached = min(stats.num_blocks_cached_free, used_free)
    counts = [s.blocks for s in segments] + [other, cached]
    cells = bar_cells(counts, total, width)
    bar = Text()
    for seg, n in zip(segments, cells):
        bar.append("█" * n, style=seg.color)
    bar.append("█" * cells[-2], style=API_COLOR)
    bar.append("▒" * cells[-1], style=CACHED_COLOR)
    bar.append("·" * max(width - sum(cells), 0), style=FREE_COLOR)
    return bar


def render_kv(stats: EngineStats, owners: dict[str, Owner], width: int, source: str = "",
              tabs: Sequence[Owner] = ()) -> Text:
    """The KV panel's body: bar, totals, one legend row per holder (and per open tab in `tabs`,
    so a reply starting or ending changes no row count: each change of the panel's height lays
    out the whole screen), cached blocks, bytes/token, tokens that still fit, and the waiting
    queue when admission holds requests back."""
    text = Text()
    if stats.num_blocks_total <= 0:
        text.append("No KV figures from this backend", style="dim")
        text.append(f"\n{source}" if source else "", style="dim")
        _append_waiting(text, stats)
        return text
    segments = kv_segments(stats, owners, tabs)
    text.append_text(render_kv_bar(stats, segments, width))
    total, used = stats.num_blocks_total, stats.num_blocks_used
    if stats.block_size <= 0:  # a remote that exposes only a usage fraction
        text.append(f"\nKV usage {used / total:.1%}")
        text.append(f"  {source}" if source else "", style="dim")
        _append_waiting(text, stats)
        return text
    text.append(f"\nused {fmt_int(used)} / {fmt_int(total)} blocks ({used / total:.0%})")
    for seg in segments:
        what = f"{seg.label} ({seg.requests} req)" if seg.label == "API" else seg.label
        text.append("\n■ ", style=seg.color)
        text.append(f"{_clip(what, width - 14):<{width - 14}}{fmt_int(seg.blocks):>8} blk")
    cached = stats.num_blocks_cached_free
    text.append("\n▒ ", style=CACHED_COLOR)
    text.append(f"{'cached prefix (free)':<{width - 14}}{fmt_int(cached):>8} blk")
    # The engine's figure accounts for sliding-window layers; a remote's falls back to blocks.
    fit = stats.num_tokens_fit if stats.num_tokens_fit is not None else max(total - used, 0) * stats.block_size
    text.append(f"\n{fmt_int(fit)} more tokens fit", style="bold")
    for line in kv_sizes(stats):
        text.append("\n" + line)
    text.append(f"\nprefix cache hits {stats.prefix_cache_hit_rate:.0%}")
    if stats.kv_disk is not None and stats.kv_disk.budget_bytes:  # configured (on, or off since a failure)
        text.append("\n" + disk_tier_line(stats.kv_disk), style="" if stats.kv_disk.enabled else "dim")
    _append_waiting(text, stats)
    return text


def disk_tier_line(disk: DiskTierStats) -> str:
    """The KV disk tier in one line: its size and what it gave back, or why it is off."""
    if not disk.enabled:
        return f"disk tier off: {disk.reason}"
    return (f"disk tier {fmt_bytes(disk.bytes_on_disk)} / {fmt_bytes(disk.budget_bytes)}, "
            f"{fmt_int(disk.num_tokens_restored)} tok restored")


def kv_sizes(stats: EngineStats) -> list[str]:
    """Lines of at most ~40 cells: the cache dtype, what a token costs and the block size; with
    sliding-window layers, what a token costs once past their window."""
    first = [stats.kv_cache_dtype] if stats.kv_cache_dtype else []
    if stats.kv_bytes_per_token:
        first.append(f"{fmt_bytes(stats.kv_bytes_per_token)}/token")
    lines = [" · ".join(first + [f"{stats.block_size} tok/block"])]
    if stats.kv_bytes_per_token_past_window:
        lines.append(f"{fmt_bytes(stats.kv_bytes_per_token_past_window)}/token past the window")
    return lines


_WAITING_FOR = {"kv": ": KV cache full", "seqs": ": max-num-seqs reached", "turn": ": queued behind prompts"}


def _append_waiting(text: Text, stats: EngineStats) -> None:
    if stats.num_waiting > 0:
        # Different waits, different remedies: more KV blocks, a higher --max-num-seqs, or patience.
        why = _WAITING_FOR.get(stats.waiting_for or "", "")
        text.append(f"\n⏳ {stats.num_waiting} waiting{why}", style="bold yellow")
    if stats.num_preemptions > 0:
        text.append(f"\n{fmt_int(stats.num_preemptions)} preemptions so far", style="yellow")


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[: max(n - 1, 0)] + "…"


class ThroughputHistory:
    """One decode-rate sample per second over the last minute (the sparkline's data)."""

    def __init__(self, seconds: int = 60) -> None:
        self.samples: deque[float] = deque([0.0] * seconds, maxlen=seconds)
        self._last: float | None = None

    def observe(self, now: float, decode_tokens_per_s: float) -> bool:
        """Record a sample if about a second has passed since the last (polls once a second come a
        little early or late); returns whether it did."""
        if self._last is not None and now - self._last < 0.9:
            return False
        self._last = now
        self.samples.append(max(decode_tokens_per_s, 0.0))
        return True


def render_step_line(stats: EngineStats) -> str:
    return (
        f"batch {stats.last_batch_size} seq · {stats.last_num_tokens} tok/step\n"
        f"step {fmt_seconds(stats.last_step_time_s) if stats.num_steps else '–'}"
        f" · {stats.num_running} running · {stats.num_waiting} waiting"
        + render_speculation(stats)
        + render_traffic(stats)
    )


def render_speculation(stats: EngineStats) -> str:
    """Speculative decoding's recent yield: the share of drafts kept, and the tokens a speculating
    sequence gains per step. Empty when it is not configured."""
    spec = stats.speculative
    if spec is None:
        return ""
    if not spec.enabled:
        return f"\nspec {spec.method}: off (ctrl+p)"
    if not spec.num_draft_tokens:
        return f"\nspec {spec.method}: no drafts yet"
    return f"\nspec {spec.acceptance_rate:.0%} kept · {spec.tokens_per_step:.1f} tok/seq-step"


def render_traffic(stats: EngineStats) -> str:
    """Why batching is nearly free: a step reads all the weights once, so the bytes read per
    generated token fall as sequences join, and the achieved bandwidth says how close the step
    comes to the memory's limit. Empty when the backend gives no such figures."""
    if not stats.weight_bytes_per_step:
        return ""
    step_bytes = stats.weight_bytes_per_step + stats.last_kv_bytes_read
    lines = f"\nread/step {fmt_bytes(stats.weight_bytes_per_step)} + KV {fmt_bytes(stats.last_kv_bytes_read)}"
    # Before the first step the line is there with dashes: its arrival would lay out the screen
    # in the first reply.
    per_token, achieved = "–", "–"
    if stats.num_steps and stats.last_num_tokens and stats.last_step_time_s > 0:
        per_token = fmt_bytes(step_bytes / stats.last_num_tokens)
        achieved = f"{step_bytes / stats.last_step_time_s / 1e9:.1f}"
    if stats.memory_bandwidth:
        achieved += f" of {stats.memory_bandwidth / 1e9:.0f}"  # the measured memory bandwidth
    return lines + f"\n{per_token}/token · {achieved} GB/s"


def render_rates(rows: list[TabRate], width: int) -> Text:
    name_w = max(width - 22, 6)
    text = Text(f"{'tab':<{name_w + 2}}{'tok/s':>8}{'TTFT':>10}", style="bold")
    for row in rows:
        text.append("\n■ ", style=row.color)
        style = "" if row.status != "idle" else "dim"
        text.append(f"{_clip(row.label, name_w):<{name_w}}{fmt_rate(row.tokens_per_s):>8}{fmt_seconds(row.ttft_s):>10}", style=style)
    return text


class PanelText(Static):
    """A panel body whose text changes several times a second but whose lines (each shorter than
    the panel is wide) rarely change in number: an update repaints it without a layout pass unless
    the line count changed, and an unchanged text costs nothing. With `keep_height`, fewer lines
    than shown keep the height (blank lines below): a reply ending and the next starting take a
    row away and back, and each change of height is a layout of the screen."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__("", markup=False, **kwargs)
        self._shown: Text | str = ""
        self._lines = 1

    def show(self, content: Text | str, keep_height: bool = False) -> None:
        lines = str(content).count("\n") + 1
        if content == self._shown and (keep_height or lines == self._lines):
            return
        self._shown = content
        if keep_height and lines < self._lines:
            content = content + "\n" * (self._lines - lines)  # Text + str is Text
            lines = self._lines
        layout, self._lines = lines != self._lines, lines
        self.update(content, layout=layout)


class PanelDigits(Digits):
    """Big digits in a cell of fixed width (the CSS): a new value only repaints them. Textual's
    Digits asks for a layout of the screen whenever the value's width changes."""

    def update(self, value: str) -> None:
        if value != self.value:
            self._value = value
            self.refresh()


class KVBudgetPanel(Vertical):
    BAR_WIDTH = 36

    def compose(self) -> ComposeResult:
        yield PanelText(id="kv-body")

    def on_mount(self) -> None:
        self.border_title = "KV cache"

    def show(self, stats: EngineStats, owners: dict[str, Owner], source: str = "", tabs: Sequence[Owner] = ()) -> None:
        body = render_kv(stats, owners, self.BAR_WIDTH, source, tabs)
        self.query_one("#kv-body", PanelText).show(body, _busy(stats))


class ThroughputPanel(Vertical):
    RATES_WIDTH = 36

    def compose(self) -> ComposeResult:
        with Horizontal(id="tp-digits"):
            with Vertical(classes="tp-cell"):
                yield Label("decode tok/s", classes="tp-label")
                yield PanelDigits("0.0", id="tp-decode")
            with Vertical(classes="tp-cell"):
                yield Label("prefill tok/s", classes="tp-label")
                yield PanelDigits("0.0", id="tp-prefill")
        yield Label("decode tok/s, last minute", classes="tp-label")
        yield Sparkline([0.0], id="tp-history")
        yield PanelText(id="tp-steps")
        yield PanelText(id="tp-rates")

    def on_mount(self) -> None:
        self.border_title = "Throughput"

    def show(self, stats: EngineStats, rows: list[TabRate], history: ThroughputHistory | None) -> None:
        self.query_one("#tp-decode", PanelDigits).update(_digits_rate(stats.decode_tokens_per_s))
        self.query_one("#tp-prefill", PanelDigits).update(_digits_rate(stats.prefill_tokens_per_s))
        if history is not None:
            sparkline = self.query_one("#tp-history", Sparkline)
            if list(sparkline.data or ()) != list(history.samples):
                sparkline.data = list(history.samples)
        self.query_one("#tp-steps", PanelText).show(render_step_line(stats), _busy(stats))
        self.query_one("#tp-rates", PanelText).show(render_rates(rows, self.RATES_WIDTH), _busy(stats))


def _busy(stats: EngineStats) -> bool:
    """While requests run, panel texts keep their height; idle, they shrink to fit."""
    return bool(stats.num_running or stats.num_waiting)


def _digits_rate(x: float | None) -> str:
    """tokens/s for the big digits: from 10 on four glyphs wide (blank-padded), so a rate moving
    between 98 and 123 stays in place instead of jumping sideways."""
    if x is not None and 10 <= x < 10_000:
        return f"{x:4.0f}"
    return fmt_rate(x)


