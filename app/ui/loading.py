"""Start-up: build the engine in a worker thread while a screen shows the loader's progress.

The engine factory is any callable `factory(progress, model, device, config) -> EngineClient` (`config`:
the app's `Config`, read once at start); it runs in a thread and reports `progress(stage, fraction)` (fraction in [0, 1], or None when unknown). The
reports land in a lock-protected `LoadProgress` that the screen polls, so a chatty loader never
blocks on the UI."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from rich.markup import escape
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import ProgressBar, Static
from textual.worker import Worker, WorkerState

from app.engine.api.engine_client import EngineClient
from app.engine.types.engine_config import DEFAULT_KV_DISK_CACHE_BYTES
from app.engine.types.progress import ProgressFn
from app.ui.format import first_line, fmt_bytes, fmt_int
from app.ui.user_config import Config
from app.ui.widgets import PromptInput


class EngineFactory(Protocol):
    def __call__(self, progress: ProgressFn, model: str | None, device: str | None, config: Config) -> EngineClient: ...


def default_engine_factory(progress: ProgressFn, model: str | None, device: str | None, config: Config,
                           **settings: Any) -> EngineClient:
    """The in-process engine (`app.engine.AsyncEngine`); `model=None` means the embedded default. Its
    settings: the KV disk tier on (`DEFAULT_KV_DISK_CACHE_BYTES`), then the config's, then
    `settings` (the command line's)."""
    from app.engine import (
        AsyncEngine,  # heavy (torch): imported in the loader thread, not at start
    )

    kwargs: dict[str, Any] = {"kv_disk_cache_bytes": DEFAULT_KV_DISK_CACHE_BYTES, **config.engine_settings(),
                              **settings, "model": model, "progress": progress, "adaptive_threads": True}
    if device:
        kwargs["device"] = device
    return AsyncEngine(**kwargs)


class LoadProgress:
    """Stages in the order reported, each with its latest fraction. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stages: dict[str, float | None] = {}

    def __call__(self, stage: str, fraction: float | None = None) -> None:
        if fraction is not None:
            fraction = min(max(float(fraction), 0.0), 1.0)
        with self._lock:
            self._stages[stage] = fraction

    def snapshot(self) -> list[tuple[str, float | None]]:
        with self._lock:
            return list(self._stages.items())


@dataclass(frozen=True)
class EngineInfo:
    model_name: str
    device: str
    dtype: str
    max_model_len: int
    kv_tokens: int
    kv_bytes: int
    chat_template: bool = True  # False: a base model, whose tabs run in completion mode
    backend: str = ""  # which kernels compute ("C kernels (AVX2)", "torch kernels: why"); "" unknown

    def headline(self) -> str:
        return " · ".join(x for x in (self.model_name, self.device, self.dtype, self.backend.split(":")[0]) if x)

    def details(self) -> list[str]:
        """Context length and KV budget, one line each (what is known), and "base model: continues
        text" for a model without a chat template (its tabs send plain-text transcripts)."""
        lines = [f"context {fmt_int(self.max_model_len)} tokens"] if self.max_model_len else []
        if self.kv_tokens:
            lines.append(f"KV budget {fmt_int(self.kv_tokens)} tokens · {fmt_bytes(self.kv_bytes)}")
        if not self.chat_template:
            lines.append("base model: continues text")
        return lines


def engine_info(engine: EngineClient) -> EngineInfo:
    """What the status line shows; empty figures (a remote server's dtype, KV budget) are left out."""
    stats = engine.stats()
    # A hybrid pool's blocks hold one KV cache group's layers each: kv_cache_tokens says what they hold.
    kv_tokens = stats.kv_cache_tokens or stats.num_blocks_total * stats.block_size
    return EngineInfo(
        model_name=engine.model_name or "model",
        device=engine.device,
        dtype=engine.dtype,
        max_model_len=engine.max_model_len,
        kv_tokens=kv_tokens,
        kv_bytes=kv_tokens * stats.kv_bytes_per_token,
        chat_template=engine.chat_template,
        backend=engine.backend,
    )


class LoadingScreen(Screen):
    """Shows the loader's stages; hands the engine to the app, or shows why loading failed. A
    message typed meanwhile is kept: sent (enter) or left in the input (a draft) once the chat
    screen is up (`carried`)."""

    BINDINGS = [Binding("q", "app.quit", "Quit")]

    def __init__(
        self,
        factory: Callable[[ProgressFn], EngineClient],
        target: str,
        failure_hint: str,
        on_loaded: Callable[[EngineClient, float], None],
        on_failed: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__()
        self._on_failed = on_failed  # None: this screen shows the error and offers to quit
        self._factory = factory
        self._target = target
        self._hint = failure_hint
        self._on_loaded = on_loaded
        self.progress = LoadProgress()
        self._started = time.monotonic()
        self.error: str | None = None
        self.queued: str | None = None  # a message sent before the model was ready
        self._draft = ""

    def compose(self) -> ComposeResult:
        with Vertical(id="loading-box"):
            yield Static("localbatch", id="loading-title")
            yield Static(f"Loading {self._target}", id="loading-target")
            yield Static("", id="loading-stages")
            yield ProgressBar(total=1.0, show_eta=False, id="loading-bar")
            yield Static("", id="loading-error")
            yield Static("", id="loading-queued")
        yield PromptInput(id="loading-input")

    def on_mount(self) -> None:
        prompt = self.query_one(PromptInput)
        prompt.load_text(self._draft)
        prompt.focus()
        if self.queued is not None:
            self._show_queued()
        self.set_interval(0.1, self._show_progress)
        self.run_worker(self._load, thread=True, exit_on_error=False, name="load-engine")

    def _load(self) -> EngineClient:
        return self._factory(self.progress)

    def _show_progress(self) -> None:
        stages = self.progress.snapshot()
        if self.error is not None or not stages:
            return
        lines = [f"[green]✓[/] {name}" for name, _ in stages[:-1]]
        name, fraction = stages[-1]
        lines.append(f"[b]›[/] {name}" + (f"  {fraction:.0%}" if fraction is not None else ""))
        self.query_one("#loading-stages", Static).update("\n".join(lines))
        bar = self.query_one("#loading-bar", ProgressBar)
        bar.update(total=1.0 if fraction is not None else None, progress=fraction or 0.0)

    def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        event.stop()
        if self.queued is not None:  # one message waits; the next one stays in the input
            self.notify("One message already waits for the model", severity="warning")
            return
        self.queued = event.text.strip()
        event.prompt_input.clear()
        self._show_queued()

    def _show_queued(self) -> None:
        self.query_one("#loading-queued", Static).update(
            f"[b]Sent when the model is ready:[/] {escape(self.queued[:200])}")

    def carry(self, draft: str, queued: str | None) -> None:
        """Take over what another loading screen held (a failed load falling back to a model);
        before this one is mounted."""
        self._draft, self.queued = draft, queued

    def carried(self) -> tuple[str, str | None]:
        """(the input's text, the message sent meanwhile)."""
        return self.query_one(PromptInput).text, self.queued

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.worker.name != "load-engine":
            return
        if event.state == WorkerState.SUCCESS:
            self._on_loaded(event.worker.result, time.monotonic() - self._started)
        elif event.state == WorkerState.ERROR:
            if self._on_failed is not None:
                self._on_failed(first_line(event.worker.error))
            else:
                self.show_error(first_line(event.worker.error))

    def show_error(self, message: str) -> None:
        self.error = message
        self.query_one("#loading-bar", ProgressBar).display = False
        self.query_one(PromptInput).display = False  # nothing to send to; q quits
        error = self.query_one("#loading-error", Static)
        error.update(f"[b red]Could not load the model:[/] {escape(message)}\n\n{self._hint}\n\nPress [b]q[/] to quit.")
        error.add_class("failed")
