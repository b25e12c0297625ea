"""What the terminal app's own thread costs while replies stream, without a model.

    localbatch bench research ui_cost --tabs 4 [--seconds 20] [--step-ms 60] [--tmux] [--headless]

The real app (real widgets, real rendering) on a paced fake engine: `app.testing`'s `FakeEngine`
stepping every `--step-ms` on a thread and event loop of its own, as the real engine's step thread
does, each delta reaching the app's loop by a thread-safe call. The replies are prose in paragraphs
with a list and a code block now and then (`--reply code`: one long code block). Reported: the CPU
share of the app's main (UI) thread while all tabs stream, and of the whole process. On a 2-core
machine every UI millisecond holding the GIL is time the engine's step thread waits for it, so this
is the app's cost to the engine. CPU time barely depends on what else the machine runs, so this
can be measured on a busy machine, unlike tok/s.

With --tmux it runs itself inside a 160x48 tmux window (a real terminal: Textual writes escape codes
and tmux parses them) and also reports the tmux server's CPU. --headless uses Textual's headless
driver (no terminal output at all), for comparison."""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from app.engine.types.outputs import StreamDelta
from app.testing.fake_engine import FakeEngine

from . import tmux

PARAGRAPH = ("The keeper climbed the hundred and twelve steps each evening, counting them aloud as his "
             "father had, and wound the great clock before he lit the lamp. ")
EXTRAS = ("\n\n- a brass carriage clock\n- a cuckoo clock with one wing\n- a ship's chronometer\n\n",
          "\n\n```python\ndef wind(clock):\n    clock.spring += 1\n    return clock\n```\n\n")


CODE_LINE = "    merged.append(left[i] if left[i] <= right[j] else right[j])  # keep the order stable\n"


def reply_tokens(kind: str = "prose") -> list[str]:
    """A long reply cut into ~4-character tokens: paragraphs, sometimes a list or code block; or
    (`code`) one long code block, as a coding model answers."""
    if kind == "code":
        text = "Here it is:\n\n```python\ndef merge(left, right):\n" + CODE_LINE * 400 + "```\n"
    else:
        text = ""
        for i in range(40):
            text += PARAGRAPH * 3 + (EXTRAS[i % 2] if i % 3 == 2 else "\n\n")
    return [text[i:i + 4] for i in range(0, len(text), 4)]


class SteppedElsewhere:
    """An engine client whose steps run on a thread and loop of their own: `stream` and `abort`
    cross to that loop, and the deltas come back to the caller's loop by `call_soon_threadsafe`,
    held up to `max_delay_s` as the real engine holds them (one call per stream, where the real
    engine makes one for all of a loop's streams); everything else is the wrapped engine's."""

    def __init__(self, engine: FakeEngine) -> None:
        self._engine = engine
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="paced-engine", daemon=True).start()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def stream(self, prompt: Any, params: Any, request_id: str | None = None,
                     max_delay_s: float = 0.0) -> AsyncIterator[StreamDelta]:
        here, inbox = asyncio.get_running_loop(), asyncio.Queue()

        async def pump() -> None:
            held: list[Any] = []
            due = float("inf")
            try:
                async for delta in self._engine.stream(prompt, params, request_id, max_delay_s=max_delay_s):
                    # Held as the real engine holds them: up to `max_delay_s`, the first token
                    # and the last delta at once, the held ones in one thread-safe call.
                    held.append(delta)
                    now = time.monotonic()
                    urgent = delta.finish_reason is not None or delta.num_output_tokens <= len(delta.token_ids)
                    due = min(due, now if urgent else now + max_delay_s)
                    if now >= due:
                        here.call_soon_threadsafe(_put_all, inbox, held)
                        held, due = [], float("inf")
            except Exception as exc:  # noqa: BLE001 - raised on the caller's side
                here.call_soon_threadsafe(_put_all, inbox, [*held, exc])

        asyncio.run_coroutine_threadsafe(pump(), self._loop)
        finished, error = False, None
        try:
            while not finished:
                item = await inbox.get()
                if isinstance(item, Exception):
                    raise item
                # Deltas that arrived together go out as one, as `AsyncEngine.stream` merges them.
                while item.finish_reason is None and not inbox.empty():
                    later = inbox.get_nowait()
                    if isinstance(later, Exception):
                        error = later
                        break
                    item = item.merged(later)
                finished = item.finish_reason is not None
                yield item
                if error is not None:
                    raise error
        finally:
            if not finished and request_id is not None:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._loop.call_soon_threadsafe(self._engine.abort, request_id)

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)


def _put_all(inbox: asyncio.Queue, items: list[Any]) -> None:
    for item in items:
        inbox.put_nowait(item)


def paced_engine(step_s: float, reply: str, tabs: int) -> SteppedElsewhere:
    """A fake engine that steps every `step_s` and answers every request with `reply_tokens(reply)`."""
    tokens = reply_tokens(reply)
    context = len(tokens) + 4096
    fake = FakeEngine(model_name="paced-fake", max_model_len=context, step_delay=step_s, max_num_seqs=max(16, tabs),
                      num_blocks=(tabs + 1) * (context // 16 + 1), script=lambda _prompt: list(tokens))
    return SteppedElsewhere(fake)


async def chat_screen(app: Any) -> Any:
    from textual.css.query import NoMatches

    from app.ui.screen import ChatScreen

    while True:
        await asyncio.sleep(0.1)
        try:
            if isinstance(app.screen, ChatScreen) and app.screen.active_pane() is not None:
                await asyncio.sleep(0.5)
                return app.screen
        except NoMatches:  # not composed yet
            pass


async def drive(app: Any, args: argparse.Namespace) -> dict:
    """Open the tabs, broadcast, and measure CPU while every tab streams."""
    screen = await chat_screen(app)
    for _ in range(args.tabs - 1):
        await screen.new_tab()
        await asyncio.sleep(0.2)
    await asyncio.sleep(0.5)
    screen.active_pane().query_one("PromptInput").insert("Tell me a long story about a lighthouse keeper.")
    screen.action_command("broadcast")
    await asyncio.sleep(args.warmup)
    profile = _start_profile(args.profile)
    wall, ui, proc = time.perf_counter(), time.thread_time(), time.process_time()
    await asyncio.sleep(args.seconds)
    wall, ui, proc = time.perf_counter() - wall, time.thread_time() - ui, time.process_time() - proc
    if profile is not None:
        profile.disable()
        profile.dump_stats(args.profile)
    result = {"tabs": args.tabs, "step_ms": args.step_ms, "seconds": wall,
              "ui_thread_cpu": ui / wall, "process_cpu": proc / wall}
    for pane in screen.panes():
        pane.stop()
    await asyncio.sleep(args.idle_warmup)
    if args.idle:
        wall, proc = time.perf_counter(), time.process_time()
        await asyncio.sleep(args.idle)
        result["idle_cpu"] = (time.process_time() - proc) / (time.perf_counter() - wall)
    return result


def _app_class() -> type:
    from app.ui.app import LocalbatchApp

    class MeasuredApp(LocalbatchApp):
        """Runs the measurement as a worker of the app (Textual calls each class's on_mount)."""

        _measure: Any = None

        def on_mount(self) -> None:
            if self._measure is not None:
                self.run_worker(self._measure())

    return MeasuredApp


def _start_profile(path: str | None) -> Any:
    """cProfile of the main thread over the measured stretch (it slows it: CPU shares then mean less)."""
    if not path:
        return None
    import cProfile

    profile = cProfile.Profile()
    profile.enable()
    return profile


def run_app(args: argparse.Namespace) -> dict:
    from app.ui.app import TuiOptions

    _MeasuredApp = _app_class()
    if args.frame_hz:  # an experiment: another paint rate
        import app.ui.screen

        app.ui.screen.FRAME_HZ = args.frame_hz

    engine = paced_engine(args.step_ms / 1000, args.reply, args.tabs)
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.toml"
        config.write_text(f"[sampling]\ntemperature = 0.0\nmax_tokens = {len(reply_tokens(args.reply)) + 16}\n")
        app = _MeasuredApp(lambda *_: engine, TuiOptions(data_dir=Path(tmp) / "data", config_path=config,
                                                               **({"poll_interval": args.poll} if args.poll else {})))
        result: dict = {}

        if args.headless:
            async def main() -> None:
                async with app.run_test(size=(160, 48)):
                    result.update(await drive(app, args))
            asyncio.run(main())
        else:
            async def measure() -> None:
                result.update(await drive(app, args))
                app.exit()

            app._measure = measure  # started by _MeasuredApp.on_mount
            app.run()
        app.store.close()
        return result


def inner_argv(args: argparse.Namespace) -> list[str]:
    """The options of the run inside tmux: these settings, without --tmux and --env."""
    argv = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in
            ("tabs", "step_ms", "seconds", "reply", "warmup", "idle", "idle_warmup", "frame_hz", "poll", "profile")
            if getattr(args, name) is not None]
    return argv + (["--headless"] if args.headless else [])


def in_tmux(args: argparse.Namespace) -> dict:
    """Run this benchmark (without --tmux) inside a 160x48 tmux window; also read tmux's CPU."""
    out = Path(tempfile.mkdtemp()) / "result.json"
    inner = [sys.executable, "-m", "app.cli", "bench", "research", "ui_cost", *inner_argv(args), "--json", str(out)]
    cmd = " ".join(shlex.quote(a) for a in inner)
    tmux.new_session(f"exec env {' '.join(args.env or [])} {cmd}", session="uicost")
    server = tmux.server_pid()
    t0, c0 = time.monotonic(), tmux.cpu_ticks(server)
    try:
        while not out.exists():
            time.sleep(0.2)
            if time.monotonic() - t0 > 600:
                raise TimeoutError
        time.sleep(0.3)
    finally:
        tmux.kill_session("uicost")
    result = {k: v for k, v in json.loads(out.read_text()).items() if k not in ("benchmark", "environment", "settings")}
    result["tmux_server_cpu_whole_run"] = tmux.cpu_seconds(tmux.cpu_ticks(server) - c0) / (time.monotonic() - t0)
    return result


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tabs", type=int, default=4)
    p.add_argument("--step-ms", type=float, default=60.0, help="one token per tab this often")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--reply", choices=("prose", "code"), default="prose", help="what the replies are")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--idle", type=float, default=0.0, help="then measure idle CPU this long")
    p.add_argument("--idle-warmup", type=float, default=3.0)
    p.add_argument("--headless", action="store_true")
    p.add_argument("--tmux", action="store_true")
    p.add_argument("--env", action="append", help="VAR=VALUE for the app (with --tmux)")
    p.add_argument("--frame-hz", type=float, default=None, help="override the reply paint rate")
    p.add_argument("--poll", type=float, default=None, help="override the panel refresh period (s)")
    p.add_argument("--profile", default=None, help="write a cProfile of the measured stretch here")


def run(args: argparse.Namespace) -> dict:
    result = in_tmux(args) if args.tmux else run_app(args)
    print(json.dumps(result))
    return result
