"""What the terminal app's own thread costs while replies stream, without a model.

    python benchmarks/ui_cost.py --tabs 4 [--seconds 20] [--step-ms 60] [--tmux] [--headless]

The real app (real widgets, real rendering) on a paced fake engine: a thread that, like the real
engine's step thread, emits one token per running tab every `--step-ms` and hands each step's
deltas to the event loop with one thread-safe call. The replies are prose in paragraphs with a list
and a code block now and then. Reported: the CPU share of the app's main (UI) thread while all tabs
stream, and of the whole process. On this 2-core machine every UI millisecond holding the GIL is
time the engine's step thread waits for it, so this is the app's cost to the engine. CPU time
barely depends on what else the machine runs, so this can be measured on a busy machine, unlike
tok/s.

With --tmux it runs itself inside a 160x48 tmux window (a real terminal: Textual writes escape codes
and tmux parses them) and also reports the tmux server's CPU. --headless uses Textual's headless
driver (no terminal output at all), for comparison."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(1, str(ROOT))

from tmux_tabs import cpu_ticks  # noqa: E402 - beside this script, which runs as one

from app.engine.types.outputs import EngineStats, RequestStats, StreamDelta  # noqa: E402

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


class PacedEngine:
    """A stand-in `EngineClient`: a step thread emits a token per running request every step."""

    model_name = "paced-fake"
    max_model_len = 8192
    device = "cpu"
    dtype = "bfloat16"
    backend = "paced"
    is_remote = False
    chat_template = True
    stats_source = ""

    def __init__(self, step_s: float, reply: str = "prose") -> None:
        self._step_s = step_s
        self._tokens = reply_tokens(reply)
        self._live: dict[str, list] = {}  # request id -> [loop, queue, position, started]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._steps = 0
        self._stats = EngineStats()
        threading.Thread(target=self._run, name="paced-engine", daemon=True).start()

    async def stream(self, prompt: Any, params: Any, request_id: str | None = None,
                     max_delay_s: float = 0.0) -> AsyncIterator[StreamDelta]:
        inbox: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._live[request_id] = [asyncio.get_running_loop(), inbox, 0, time.monotonic()]
        try:
            while True:
                delta = await inbox.get()
                yield delta
                if delta.finish_reason:
                    return
        finally:
            with self._lock:
                self._live.pop(request_id, None)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Bytes as tokens: the input's context meter counts with it, as with a real tokenizer."""
        return [1] * add_bos + list(text.encode())

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: Any = None) -> str:
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>" * add_generation_prompt

    def abort(self, request_id: str) -> None:
        with self._lock:
            entry = self._live.get(request_id)
        if entry is not None:
            entry[0].call_soon_threadsafe(entry[1].put_nowait, StreamDelta(request_id, "", [], "abort"))

    def stats(self) -> EngineStats:
        return self._stats

    async def aclose(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._step_s):
            per_loop: dict[Any, list] = {}
            with self._lock:
                for rid, entry in self._live.items():
                    loop, inbox, pos, _ = entry
                    if pos >= len(self._tokens):
                        continue
                    entry[2] = pos + 1
                    finish = "length" if pos + 1 == len(self._tokens) else None
                    delta = StreamDelta(rid, self._tokens[pos], [pos], finish, num_output_tokens=pos + 1)
                    per_loop.setdefault(loop, []).append((inbox, delta))
                self._steps += 1
                self._stats = self._snapshot()
            for loop, batch in per_loop.items():
                loop.call_soon_threadsafe(_deliver, batch)

    def _snapshot(self) -> EngineStats:
        now = time.monotonic()
        rows = tuple(
            RequestStats(request_id=rid, status="decode", num_prompt_tokens=40, num_output_tokens=pos,
                         num_blocks=3 + pos // 16, num_cached_tokens=0, ttft_s=0.2, itl_s=self._step_s,
                         tokens_per_s=pos / max(now - started, 1e-3))
            for rid, (_, _, pos, started) in self._live.items()
        )
        n = len(rows)
        return EngineStats(num_running=n, num_blocks_total=15856, num_blocks_used=sum(r.num_blocks for r in rows),
                           block_size=16, kv_bytes_per_token=23040, weight_bytes_per_step=135_000_000,
                           last_kv_bytes_read=n * 1_000_000, copy_bandwidth=15e9, decode_tokens_per_s=n / self._step_s, last_batch_size=n,
                           last_num_tokens=n, last_step_time_s=self._step_s * (0.9 + 0.2 * (self._steps % 5) / 5),
                           num_steps=self._steps, total_output_tokens=sum(r.num_output_tokens for r in rows),
                           requests=rows)


def _deliver(batch: list) -> None:
    for inbox, delta in batch:
        inbox.put_nowait(delta)


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
        await screen.action_new_tab()
        await asyncio.sleep(0.2)
    await asyncio.sleep(0.5)
    screen.active_pane().query_one("PromptInput").insert("Tell me a long story about a lighthouse keeper.")
    screen.action_broadcast()
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

    engine = PacedEngine(args.step_ms / 1000, args.reply)
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.toml"
        config.write_text("[sampling]\ntemperature = 0.0\nmax_tokens = 100000\n")
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


def in_tmux(args: argparse.Namespace) -> dict:
    """Run this script (without --tmux) inside a 160x48 tmux window; also read tmux's CPU."""
    out = Path(tempfile.mkdtemp()) / "result.json"
    argv = [a for a in sys.argv[1:] if a != "--tmux"]
    cmd = " ".join([sys.executable, str(Path(__file__).resolve()), *argv, "--out", str(out)])
    env = " ".join(args.env or [])
    subprocess.run(["tmux", "new-session", "-d", "-s", "uicost", "-x", "160", "-y", "48",
                    f"cd {ROOT} && exec env {env} {cmd}"], check=True)
    server = int(subprocess.run(["tmux", "display", "-p", "#{pid}"], capture_output=True, text=True).stdout)
    t0, c0 = time.monotonic(), cpu_ticks(server)
    try:
        while not out.exists():
            time.sleep(0.2)
            if time.monotonic() - t0 > 600:
                raise TimeoutError
        time.sleep(0.3)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", "uicost"], capture_output=True)
    result = json.loads(out.read_text())
    result["tmux_server_cpu_whole_run"] = (cpu_ticks(server) - c0) / os.sysconf("SC_CLK_TCK") / (time.monotonic() - t0)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    p.add_argument("--out", default=None)
    p.add_argument("--profile", default=None, help="write a cProfile of the measured stretch here")
    args = p.parse_args()
    if args.tmux:
        print(json.dumps(in_tmux(args)))
        return
    result = run_app(args)
    if args.out:
        Path(args.out).write_text(json.dumps(result))
    else:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
