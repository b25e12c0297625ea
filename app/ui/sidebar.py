"""The chat screen's right column: the model line, the KV-budget and throughput panels, the
embedded endpoint's line and a model pull's progress, redrawn from one `engine.stats()` snapshot."""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from app.engine.api.engine_client import EngineClient
from app.engine.types.errors import LocalbatchError
from app.engine.types.outputs import EngineStats, RequestStats
from app.ui.chat import ChatPane
from app.ui.endpoint import EmbeddedEndpoint
from app.ui.format import first_line
from app.ui.loading import EngineInfo
from app.ui.message_list import reading_line
from app.ui.panels import KVBudgetPanel, Owner, PanelText, TabRate, ThroughputHistory, ThroughputPanel


class Sidebar(Vertical):
    """See the module docstring. `endpoint_note` is the endpoint's passing state ("starting on …",
    "failed: …"); `endpoint_key` names the key that toggles it."""

    def __init__(self, engine: EngineClient, info: EngineInfo, endpoint: EmbeddedEndpoint | None,
                 endpoint_key: Callable[[], str], **kwargs: object) -> None:
        super().__init__(**kwargs)
        self._engine = engine
        self._info = info
        self._endpoint = endpoint
        self._endpoint_key = endpoint_key
        self.endpoint_note = ""
        self.history = ThroughputHistory()
        self.engine_busy = False  # the last stats snapshot had requests running or waiting
        self._prefill_rate = 0.0  # tokens/s, the engine's latest nonzero prefill rate
        self._pull_text: str | None = None

    def compose(self) -> ComposeResult:
        text = Text(self._info.headline(), style="bold")
        for line in self._info.details():
            text.append("\n" + line, style="dim")
        yield Static(text, id="model-info")
        yield KVBudgetPanel(id="kv-panel")
        yield ThroughputPanel(id="tp-panel")
        yield PanelText(id="endpoint-status")
        yield Static("", id="pull-status")

    async def toggle_endpoint(self, start: bool | None = None) -> None:
        """Start or stop the embedded endpoint (`start` None: whichever it is not); its line says
        how that goes, a notice what came of it."""
        endpoint = self._endpoint
        if endpoint is None:
            self.notify("This backend has no embedded endpoint", severity="warning")
            return
        if start is None:
            start = not endpoint.running
        if not start:
            await endpoint.stop()
            self.notify("Endpoint stopped")
            return
        self.endpoint_note = f"starting on {endpoint.address} …"
        try:
            address = await endpoint.start()
        except LocalbatchError as e:
            self.endpoint_note = f"failed: {e}"
            self.notify(str(e), title="Endpoint", severity="error")
            return
        self.endpoint_note = ""
        self.notify(f"Serving the OpenAI API on {address}", title="Endpoint")

    def show_stats(self, panes: list[ChatPane], now: float | None = None) -> None:
        """Redraw the panels from one stats snapshot; the tabs learn the engine's figures from it."""
        engine = self._engine
        try:
            stats = engine.stats()
        except LocalbatchError as e:
            self.query_one("#endpoint-status", PanelText).show(Text(f"engine: {first_line(e)}", style="bold red"))
            return
        self.engine_busy = bool(stats.num_running or stats.num_waiting)
        self._prefill_rate = _read_rate(stats, self._prefill_rate)
        for pane in panes:
            pane.session.context.prefill_rate = self._prefill_rate
            pane.session.context.kv_pool_tokens = stats.num_blocks_total * stats.block_size
        tab_owners = [Owner(p.id, p.session.chat.title, p.color) for p in panes]
        owners = {p.session.request_id: owner for p, owner in zip(panes, tab_owners) if p.session.request_id}
        # A remote server's figures say nothing of what an idle tab holds: no row for it there.
        tabs = [] if engine.is_remote else tab_owners
        self.query_one(KVBudgetPanel).show(stats, owners, engine.stats_source, tabs)
        self.history.observe(time.monotonic() if now is None else now, stats.decode_tokens_per_s)
        self.query_one(ThroughputPanel).show(stats, _rate_rows(stats, panes, owners), self.history)
        self.query_one("#endpoint-status", PanelText).show(self._endpoint_text())

    def _endpoint_text(self) -> Text:
        endpoint = self._endpoint
        if endpoint is None:
            return Text("remote backend", style="dim")
        if endpoint.running and not self.endpoint_note:
            return Text.assemble(("API ", "bold"), (endpoint.address, "bold green"))
        if self.endpoint_note or endpoint.error:
            return Text.assemble(("API ", "bold"), (self.endpoint_note or f"stopped: {endpoint.error}", "yellow"))
        return Text.assemble(("API ", "bold"), (f"off · {self._endpoint_key()} serves on port {endpoint.port}", "dim"))

    def on_mount(self) -> None:
        self.set_interval(0.25, self._paint_pull)

    def _paint_pull(self) -> None:
        """The pull line, from the pull thread's latest report (hidden when none runs)."""
        state = getattr(self.app, "pulling", None)
        text = state.line() if state is not None and not state.done else ""
        if text != self._pull_text:
            self._pull_text = text
            widget = self.query_one("#pull-status", Static)
            widget.update(text)
            widget.display = bool(text)


def _rate_rows(stats: EngineStats, panes: list[ChatPane], owners: dict[str, Owner]) -> list[TabRate]:
    by_id = {r.request_id: r for r in stats.requests}
    rows = [_pane_rate(p, by_id.get(p.session.request_id or ""), stats.prefill_tokens_per_s) for p in panes]
    api = [r for r in stats.requests if r.request_id not in owners]
    if api:
        rates = [r.tokens_per_s for r in api if r.tokens_per_s is not None]
        ttfts = [r.ttft_s for r in api if r.ttft_s is not None]
        rows.append(
            TabRate(
                f"API ({len(api)} req)", "grey70", sum(rates) if rates else None,
                sum(ttfts) / len(ttfts) if ttfts else None, "decode",
            )
        )
    return rows


def _pane_rate(pane: ChatPane, req: RequestStats | None, prefill_rate: float = 0.0) -> TabRate:
    reply = pane.session.reply
    if req is not None and req.status in ("waiting", "prefill") and pane.live is not None:
        pane.live.show_reading(reading_line(req.status, req.num_computed_tokens, req.num_prompt_tokens, prefill_rate))
    tps = reply.metrics.tokens_per_s if reply else None
    ttft = reply.metrics.ttft_s if reply else None
    if req is not None:
        tps = req.tokens_per_s if req.tokens_per_s is not None else tps
        ttft = req.ttft_s if req.ttft_s is not None else ttft
        reply.engine_figures = (tps, ttft)
        if req.num_cached_tokens:
            reply.cache_hit = (req.num_cached_tokens, req.num_prompt_tokens, req.num_disk_cached_tokens)
        status = req.status
    elif reply is not None and reply.engine_figures is not None:
        tps, ttft = reply.engine_figures
        status = "decode" if pane.generating else "idle"
    elif pane.generating:
        status = "decode" if ttft is not None else "waiting"
    else:
        status = "idle"
    return TabRate(pane.session.chat.title, pane.color, tps, ttft, status)


def _read_rate(stats: EngineStats, last: float) -> float:
    """Tokens a second a prompt is read at, for the input's cost estimate: the prompts read lately
    (their uncached tokens over their time to first token, queueing included: the wait a person
    sees); the engine's recent prefill rate (which counts decode-only steps too) until there is
    one; idle, the last one."""
    read = [(r.num_prompt_tokens - r.num_cached_tokens) / r.ttft_s for r in stats.requests
            if r.ttft_s and r.num_prompt_tokens - r.num_cached_tokens >= 64]
    if read:
        return max(read)
    return last or stats.prefill_tokens_per_s
