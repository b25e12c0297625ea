"""The `localbatch` Textual app and its entry point `run_tui`."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen

from app import ASSETS_DIR
from app.engine.api.engine_client import EngineClient
from app.engine.types.errors import LocalbatchError
from app.engine.types.outputs import SpecStats
from app.engine.types.progress import ProgressFn
from app.tools.config import read_tools_config
from app.tools.manager import ServerState, ToolManager
from app.ui.endpoint import EmbeddedEndpoint, ServeFn
from app.ui.commands import COMMANDS, effective_keys, palette_help
from app.ui.loading import (
    EngineFactory,
    LoadingScreen,
    default_engine_factory,
    engine_info,
)
from app.ui.pulling import PullState, start_pull
from app.ui.screen import ChatScreen
from app.ui.store import ChatStore
from app.ui.tools_view import ToolsScreen
from app.ui.user_config import (
    Config,
    ConfigError,
    default_config_path,
    default_data_dir,
    load_config,
)

MODEL_KEY = "model"  # meta key: the model last switched to, loaded at the next start
_DEFAULT = object()  # a fallback that means "the default model" (None means "no fallback")


@dataclass
class TuiOptions:
    """What the command line can set; `None` falls back to the config file, then to defaults."""

    model: str | None = None
    device: str | None = None
    data_dir: Path | None = None
    config_path: Path | None = None
    serve: bool = False  # start the embedded endpoint once the model is loaded
    host: str | None = None
    port: int | None = None
    api_key: str | None = None  # the endpoint's key, or the remote backend's
    backend_url: str | None = None  # run the tabs against a remote OpenAI-compatible server
    # Panel refresh period in seconds (rounded to frames); 0: no polling (tests). Once a second, as
    # htop: faster refreshes cost the UI thread, and so the engine, CPU (docs/tuning.md).
    poll_interval: float = 1.0
    serve_fn: ServeFn | None = None  # replaces app.server.serve (tests)
    mcp_config: Path | None = None  # a Claude Desktop / Cursor mcp.json (`--mcp-config`)
    tools: bool = True  # start the MCP servers (tests of other things turn them off)


class LocalbatchApp(App):
    CSS_PATH = str(ASSETS_DIR / "localbatch.tcss")
    TITLE = "localbatch"
    BINDINGS = [Binding("ctrl+q", "quit", "Quit", priority=True, id="quit")]

    def __init__(self, engine_factory: EngineFactory | None = None, options: TuiOptions | None = None) -> None:
        super().__init__()
        self.options = options or TuiOptions()
        explicit = self.options.config_path is not None
        self.config: Config = load_config(self.options.config_path, explicit=explicit)
        self.data_dir = Path(self.options.data_dir or default_data_dir()).expanduser()
        self.keys = effective_keys(self.config.keymap)
        if self.config.keymap:
            self.set_keymap(self.config.keymap)
        if self.config.theme:
            if self.config.theme not in self.available_themes:
                raise ConfigError(
                    f"unknown theme {self.config.theme!r} in {self.config.path}; try one of: "
                    + ", ".join(sorted(self.available_themes)[:8])
                )
            self.theme = self.config.theme
        self.store = ChatStore.in_dir(self.data_dir, self.config.sampling)
        self.store.on_write_error = self._store_unwritable
        self._factory = engine_factory or default_engine_factory
        self.engine: EngineClient | None = None
        self.endpoint: EmbeddedEndpoint | None = None
        self.model: str | None = None  # what was asked for (catalog name or path); None: the default
        self._remember: str | None = None  # a model switched to, stored as the next start's model once loaded
        self._serve_after_load = False  # the endpoint was serving when the model was switched
        self.pulling: PullState | None = None  # the latest model pull started from the picker
        self._store_warned = False
        self.tools: ToolManager | None = None  # the MCP servers, started at mount
        self.tools_off_reason = ""  # why there is none (a bad config entry)
        self._failed_seen: set[str] = set()  # servers whose failure was already said

    # start-up

    def on_mount(self) -> None:
        self._start_tools()
        if self.options.backend_url:
            hint = "Check the address given with --backend-url (it ends in /v1) and --api-key."
            self.push_screen(LoadingScreen(self._connect, self.options.backend_url, hint, self._engine_loaded))
            return
        chosen = self.options.model or self.config.model
        remembered = self.store.get_meta(MODEL_KEY)
        if chosen or not remembered:
            self.push_screen(self._loading_screen(chosen))
        else:  # the model last switched to; should it be gone (rm), the default model instead
            self.push_screen(self._loading_screen(remembered, fallback=_DEFAULT))

    def _loading_screen(self, model: str | None, fallback: object = None) -> LoadingScreen:
        """Loads `model` (None: the default); a failure shows the error, or loads `fallback`."""
        config = self.config.path or default_config_path()
        hint = f'Pass a GGUF file with [b]localbatch --model PATH.gguf[/b], or set model = "PATH" in {config}.'
        on_failed = None if fallback is None else partial(self._load_failed, model, fallback)
        device = self.options.device or self.config.device
        return LoadingScreen(lambda progress: self._factory(progress, model, device, self.config), model or "the default model",
                             hint, partial(self._model_loaded, model), on_failed)

    def _load_failed(self, model: str | None, fallback: object, message: str) -> None:
        self.notify(f"{model}: {message}", title="Could not load the model", severity="error", timeout=15)
        screen = self._loading_screen(None if fallback is _DEFAULT else fallback)  # type: ignore[arg-type]
        screen.carry(*self._typed_while_loading())
        self.switch_screen(screen)

    def _typed_while_loading(self) -> tuple[str, str | None]:
        return self.screen.carried() if isinstance(self.screen, LoadingScreen) else ("", None)

    def _connect(self, progress: ProgressFn) -> EngineClient:
        """Runs in the loader thread."""
        from app.clients.remote import RemoteEngine

        progress(f"connecting to {self.options.backend_url}", None)
        return RemoteEngine.connect(self.options.backend_url, api_key=self.options.api_key)

    def _model_loaded(self, model: str | None, engine: EngineClient, elapsed_s: float) -> None:
        self.model = model
        self._engine_loaded(engine, elapsed_s)

    async def switch_model(self, target: str) -> None:
        """Stop every reply (what was written is kept), unload the model, load `target` with its
        progress shown. Chats live in the store, so the new chat screen has them all; a failed load
        brings the previous model back. The endpoint, if it was serving, serves the new model."""
        chat = next((s for s in self.screen_stack if isinstance(s, ChatScreen)), None)
        if chat is None or self.engine is None or self.engine.is_remote:
            return
        self._serve_after_load = self.endpoint is not None and self.endpoint.running
        await chat.stop_all_and_wait()
        previous = self.model
        # The old model goes first: the new one sizes its KV pool from the memory left free.
        await self.close_engine()
        self._remember = target
        self.switch_screen(self._loading_screen(target, fallback=_DEFAULT if previous is None else previous))

    def _engine_loaded(self, engine: EngineClient, elapsed_s: float) -> None:
        self.engine = engine
        if self._remember is not None and self.model == self._remember:
            self.store.set_meta(MODEL_KEY, self._remember)
        self._remember = None
        info = engine_info(engine)
        if not engine.is_remote:
            self.endpoint = EmbeddedEndpoint(
                engine,
                self.options.host or self.config.server_host,
                self.options.port or self.config.server_port,
                self.options.api_key,
                self.options.serve_fn,
            )
        draft, queued = self._typed_while_loading()
        screen = ChatScreen(engine, self.store, info, self.endpoint, self.export_dir, self.options.poll_interval)
        self.switch_screen(screen)
        screen.call_after_refresh(screen.take_input, draft, queued)
        self.notify(f"{info.headline()} ready in {elapsed_s:.1f} s", title="Model loaded")
        if self.store.write_error is not None and not self._store_warned:  # failed before the app ran
            self._store_unwritable(f"cannot save chats to {self.store.path} ({self.store.write_error}): they are "
                                   "kept in memory until the app exits")
        if not engine.is_remote and not engine.chat_template:
            self._no_chat_model_hint()
        if engine.backend.startswith("torch kernels") and engine.device == "cpu":
            self.notify(f"The fast CPU kernels are off ({engine.backend.split(': ', 1)[-1]}): replies run about 3x "
                        "slower. `localbatch doctor` says more.", severity="warning", timeout=30)
        if self.options.serve or self._serve_after_load:
            screen.call_after_refresh(screen.action_command, "toggle_endpoint")
        self._serve_after_load = False

    def _store_unwritable(self, message: str) -> None:
        """Said once: the chats cannot be saved (read-only or full disk); the app keeps them in memory."""
        if self._store_warned or not self.is_running:
            return
        self._store_warned = True
        self.notify(message, title="Chats not saved", severity="error", timeout=30)

    def _no_chat_model_hint(self) -> None:
        """A base model is loaded: if no chat model is pulled either, say how to get one."""
        from app.engine.gguf.catalog import CATALOG, CHAT_DEFAULT, CHAT_PREFERENCE, installed_path

        if any(installed_path(name) for name in CHAT_PREFERENCE):
            return
        key = self.keys["switch_model"].split(",")[0]
        size = CATALOG[CHAT_DEFAULT].size / 1e9
        self.notify(f"No chat model is pulled, so this base model only continues text. Press {key} to pull "
                    f"{CHAT_DEFAULT} ({size:.1f} GB) here, or run `localbatch pull {CHAT_DEFAULT}`.",
                    title="No chat model", severity="warning", timeout=30)

    def pull_model(self, name: str) -> None:
        """Pull catalog model `name` in a thread while the current model keeps serving; the chat
        screen shows its progress, and a note says when it is done (or why not)."""
        if self.pulling is not None and not self.pulling.done:
            self.notify(f"Already pulling {self.pulling.name}", severity="warning")
            return
        from app.engine.gguf.pull import pull

        self.pulling = start_pull(name, pull, self._pull_ended)
        self.notify(f"Pulling {name}; the current model keeps serving", title="Pull")

    def _pull_ended(self, state: PullState) -> None:
        """From the pull's thread: one hand-off to the UI thread (gone if the app has exited)."""
        with contextlib.suppress(RuntimeError):  # the app has exited: nobody to tell
            self.call_from_thread(self._pull_done, state)

    def _pull_done(self, state: PullState) -> None:
        if state.error:
            self.notify(f"Could not pull {state.name}: {state.error}", title="Pull failed", severity="error", timeout=20)
            return
        key = self.keys["switch_model"].split(",")[0]
        self.notify(f"{state.name} is pulled: press {key} to switch to it", title="Pull done", timeout=20)

    def export_dir(self) -> Path:
        return self.config.export_dir or self.data_dir / "exports"

    # MCP tools

    def _start_tools(self) -> None:
        """Start the MCP servers in the background (the manager's own thread): neither the UI
        nor the engine waits for them. A bad entry in the config says so and tools stay off."""
        if not self.options.tools:
            self.tools_off_reason = "Tools are off"
            return
        try:
            config = read_tools_config(self.config.path, self.options.mcp_config)
        except LocalbatchError as e:
            self.tools_off_reason = f"Tools are off: {e}"
            self.notify(str(e), title="Tools are off", severity="error", timeout=20)
            return
        loop = asyncio.get_running_loop()

        def changed() -> None:
            # One hand-off to the UI thread per change of a server (never per token); it does not
            # wait for the UI, so closing the manager from any thread cannot deadlock on it.
            with contextlib.suppress(RuntimeError):  # the app's loop is closed: nobody to tell
                loop.call_soon_threadsafe(self._tools_changed)

        self.tools = ToolManager(config, Path.cwd(), on_change=changed)
        self.tools.start()

    def _tools_changed(self) -> None:
        manager = self.tools
        if manager is None or not self.is_running:
            return
        for status in manager.servers():
            failed = status.enabled and status.state is ServerState.FAILED
            if failed and status.name not in self._failed_seen:
                self.notify(status.line(), title="MCP server failed", severity="warning", timeout=12)
            (self._failed_seen.add if failed else self._failed_seen.discard)(status.name)
        for screen in self.screen_stack:
            if isinstance(screen, ToolsScreen):
                screen.refresh_rows()

    async def close_tools(self, wait_s: float = 1.5) -> None:
        """Stop the servers off the UI thread; the exit waits `wait_s` at most (a server that does
        not stop then is left to end with its stdin closed when the app exits)."""
        manager, self.tools = self.tools, None
        if manager is None:
            return
        manager.on_change = None
        done = threading.Event()

        def close() -> None:
            manager.close()
            done.set()

        threading.Thread(target=close, name="mcp-close", daemon=True).start()
        await asyncio.to_thread(done.wait, wait_s)

    # command palette

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        if not isinstance(screen, ChatScreen):
            return
        spec = self._speculative_stats()
        if spec is not None:
            yield SystemCommand(f"Speculative decoding: turn {'off' if spec.enabled else 'on'}",
                                f"Now {'on' if spec.enabled else 'off'} ({spec.draft_model or spec.method}); "
                                "greedy replies stay the same",
                                partial(self.toggle_speculation, not spec.enabled))
        for command in COMMANDS:
            yield SystemCommand(command.title, palette_help(command, self.keys), partial(screen.action_command, command.id))

    def _speculative_stats(self) -> SpecStats | None:
        if self.engine is None:
            return None
        try:
            return self.engine.stats().speculative
        except LocalbatchError:
            return None

    def toggle_speculation(self, enabled: bool) -> None:
        if self.engine is not None and self.engine.set_speculation(enabled):
            self.notify(f"Speculative decoding {'on' if enabled else 'off'}")
        else:
            self.notify("This engine was started without --speculative-config", severity="warning")

    # shutdown

    async def action_quit(self) -> None:
        """Commit partial replies, stop the endpoint and the engine, then exit."""
        chat = next((s for s in self.screen_stack if isinstance(s, ChatScreen)), None)
        if chat is not None:  # also under an open dialog
            await chat.stop_all_and_wait()
        await asyncio.gather(self.close_tools(), self.close_engine())
        self.exit()

    async def close_engine(self) -> None:
        if self.endpoint is not None:
            await self.endpoint.stop()
        engine, self.engine = self.engine, None
        if engine is not None:
            await engine.aclose()


def run_tui(engine_factory: EngineFactory | None = None, options: TuiOptions | None = None, **overrides: Any) -> None:
    """Run the app until the user quits.

    `engine_factory(progress, model, device, config)` builds the engine in a worker thread (default:
    `loading.default_engine_factory`); `overrides` are `TuiOptions` fields (`model=`, `data_dir=`, ...).
    Raises `LocalbatchError` (bad config, unusable chat database) before the screen opens."""
    options = replace(options or TuiOptions(), **overrides)
    app = LocalbatchApp(engine_factory, options)
    try:
        app.run()
    finally:
        app.store.close()
        if app.tools is not None:  # an exit that skipped quit: the servers' stdin closes as the app exits
            app.tools.on_change = None
        _close_left_over(app.engine)


def _close_left_over(engine: EngineClient | None) -> None:
    """The app closes the engine on quit; this covers exits that skipped that (a crash). The app's
    event loop is gone by now, so this runs on a fresh one."""
    # A remote engine's client belongs to the dead loop and holds only sockets: leave it be.
    if engine is not None and not engine.is_remote:
        asyncio.run(engine.aclose())
