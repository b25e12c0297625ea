"""Does the app in a real terminal slow its engine? The app in tmux (160x48) against the engine alone.

    localbatch bench research app_vs_engine [--tabs 1,4,8] [--rounds 8] [--model NAME] [--max-tokens 384]
        [--prompt TEXT] [--engine-args "..."] [--as-shipped] [--json PATH]
    localbatch bench research app_vs_engine --unpaired [--tabs 1,4,8] [--idle 30] [--pyspy DIR] [--remote URL]

Paired (the default): the app and the engine alone both stay loaded and take turns seconds apart,
the order switching each round, the side not taking its turn stopped (SIGSTOP), so the VM's drift
moves a pair's ratio less than runs a minute apart would. The engine alone is `app.bench.worker`
(an `LLMEngine` as `localbatch bench` builds it) decoding N copies of the tabs' question through
the chat template, greedy, so both sides decode the same tokens: the app's built-in tools are not
offered (their prompt and the calls' grammar would make its steps other steps) and its KV disk
tier is off, as the engine alone's (`--as-shipped` keeps both, to see what they cost). The app runs
with the embedded endpoint on and `/metrics` scraped once a second during its turns; each turn closes the last
turn's tabs (ctrl+w), opens N fresh ones, types the prompt and broadcasts it (ctrl+b). Its figure is
the replies' tok/s as the app measured and stored them, summed over the tabs, against the engine's
decode tok/s. The first turn of each side is a warm-up. Reported: the median of the pairs' ratios,
both sides' step time and time between steps.

Unpaired: one fresh app per tab count, read off the screen a few times a second while all tabs
decode (the throughput panel's step time), with the process's, the UI thread's and tmux's CPU from
/proc; `--idle S` then the idle app's CPU; `--remote URL` the app on `--backend-url` (compare with
`localbatch bench serve --url URL --endpoint chat`). Needs tmux; Linux only. The machine must be
otherwise quiet: the load average is printed."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from app.bench.datasets import CHAT_PROMPT
from app.bench.paired import EngineWorker, Turn, format_rows, summary_row, turns
from app.bench.server import Scraper, fetch_counters
from app.bench.stats import counter_step_split
from ..engine_options import engine_kwargs_from_argv

from . import tmux


class App:
    """The app in tmux with the endpoint on; each turn asks N fresh tabs the same question at once."""

    def __init__(self, args: argparse.Namespace, tabs: int, data: Path) -> None:
        self.tabs, self.url, self._data = tabs, f"http://127.0.0.1:{args.port}", data / "data"
        self._prompt, self._timeout = args.prompt, args.timeout
        # As shipped, the app offers its tools and keeps the KV disk tier; by default neither, as
        # the engine alone: both sides then compute the same steps for the same tokens.
        same = [] if args.as_shipped else ["--kv-disk-cache-bytes", "0"]
        self.pid = tmux.start_app(data, args.max_tokens, args.model,
                                  ["--serve", "--port", str(args.port), *same, *args.engine_args.split()],
                                  tools=args.as_shipped)
        tmux.open_tabs(tabs - 1)
        self._broadcast()  # warm-up
        os.kill(self.pid, signal.SIGSTOP)

    def turn(self) -> Turn:
        os.kill(self.pid, signal.SIGCONT)
        time.sleep(1.0)  # Textual takes the terminal back on SIGCONT: keys sent meanwhile can be lost
        self._close_tabs()
        tmux.open_tabs(self.tabs - 1)
        time.sleep(0.8)
        before = fetch_counters(self.url)
        with Scraper(self.url, 1.0) as scraper:
            replies = self._broadcast()
        split = counter_step_split(before, fetch_counters(self.url))
        os.kill(self.pid, signal.SIGSTOP)
        tokens = sorted(n for n, _ in replies)
        return Turn(sum(rate for _, rate in replies), split,
                    f"replies of {tokens[0]}-{tokens[-1]} tok; {scraper.summary()}")

    def _close_tabs(self) -> None:
        """Every tab with a reply closed (ctrl+w: the chat is kept, out of the tabs); the last one
        closed leaves a new empty tab."""
        for _ in range(2 * self.tabs + 2):
            left = len(tmux.replies(self._data))
            if not left:
                return
            tmux.tmux("send-keys", "-t", tmux.SESSION, "C-w")
            with contextlib.suppress(TimeoutError):  # the key was lost: again
                tmux.wait_for(lambda s: len(tmux.replies(self._data)) < left, 3)  # noqa: B023
        raise RuntimeError(f"{len(tmux.replies(self._data))} replies left after closing the tabs")

    def _broadcast(self) -> list[tuple[int, float]]:
        """The prompt sent to every tab at once; the replies' (tokens, tok/s) once all have ended."""
        tmux.broadcast(self._prompt)
        tmux.wait_for(tmux.busy, 30)
        tmux.wait_for(lambda s: not tmux.busy(s), self._timeout)
        time.sleep(0.5)  # the replies' rows committed
        replies = tmux.replies(self._data)
        if len(replies) != self.tabs:
            raise RuntimeError(f"expected {self.tabs} replies, found {len(replies)}")
        return replies

    def close(self) -> None:
        os.kill(self.pid, signal.SIGCONT)
        tmux.quit_app()


def paired(args: argparse.Namespace, tabs: int) -> list:
    engine_argv = [*(["--model", args.model] if args.model else []), "--device", "cpu", *args.engine_args.split()]
    with EngineWorker(engine_kwargs_from_argv(engine_argv), args.max_tokens, chat_prompt=args.prompt) as worker:
        worker.run(tabs)  # warm-up
        with tempfile.TemporaryDirectory(prefix="lbpairs") as tmp:
            app = App(args, tabs, Path(tmp))
            try:
                return turns(app.turn, worker.turn(tabs, "decode_tok_s"), args.rounds, f"app, {tabs} tabs")
            finally:
                app.close()


@dataclass
class Run:
    """One unpaired run: what the screen and /proc showed while all tabs decoded."""

    tabs: int
    steps_ms: list[float] = field(default_factory=list)
    cpu: float = 0.0
    ui_cpu: float = 0.0
    tmux_cpu: float = 0.0
    replies: list[tuple[int, float]] = field(default_factory=list)  # (tokens, tok/s) per reply, from the chat DB
    load_before: float = 0.0
    load_after: float = 0.0

    def line(self) -> str:
        parts = [f"{self.tabs:>2} tabs:"]
        if self.steps_ms:
            step = statistics.median(self.steps_ms)
            parts.append(f"step p50 {step:6.1f} ms (n={len(self.steps_ms)}, min {min(self.steps_ms):.0f} "
                         f"max {max(self.steps_ms):.0f}) = {self.tabs * 1000 / step:6.1f} tok/s;")
        if self.replies:
            tokens = sorted(n for n, _ in self.replies)
            parts.append(f"replies: {sum(r for _, r in self.replies):6.1f} tok/s summed over {len(self.replies)} "
                         f"({tokens[0]}-{tokens[-1]} tok);")
        parts.append(f"process CPU {self.cpu:.0%}, UI thread {self.ui_cpu:.0%}, tmux {self.tmux_cpu:.0%}; "
                     f"load {self.load_before:.2f} -> {self.load_after:.2f}")
        return " ".join(parts)


def unpaired(args: argparse.Namespace, n: int) -> Run:
    run = Run(n, load_before=os.getloadavg()[0])
    with tempfile.TemporaryDirectory(prefix="lbtmux") as tmp:
        pid = tmux.start_app(Path(tmp), args.max_tokens, args.model, args.engine_args.split(), args.env, args.remote,
                             tools=args.as_shipped)
        try:
            tmux.open_tabs(n - 1)
            tmux.broadcast(args.prompt)
            sample(run, pid, n, args)
            tmux.wait_for(lambda s: not tmux.busy(s), args.timeout)
            run.replies = tmux.replies(Path(tmp) / "data")
            if args.idle and n == args.idle_after:
                idle_cpu(pid, args.idle)
        finally:
            tmux.quit_app()
    run.load_after = os.getloadavg()[0]
    return run


def _ticks(pid: int, server: int) -> tuple[float, int, int, int]:
    return time.monotonic(), tmux.cpu_ticks(pid), tmux.cpu_ticks(pid, pid), tmux.cpu_ticks(server)


def sample(run: Run, pid: int, n: int, args: argparse.Namespace) -> None:
    """The panels while all `n` tabs decode (a remote backend has no step line: from the first
    reply text to the last busy tab); CPU over the same stretch."""
    server = tmux.server_pid()
    start = last = None
    if args.remote:
        tmux.wait_for(lambda s: "Assistant" in s, args.timeout)
        start = _ticks(pid, server)
        spy(pid, n, args)
        tmux.wait_for(lambda s: not tmux.busy(s), args.timeout)
        last = _ticks(pid, server)
    else:
        end, seen = time.monotonic() + args.timeout, None
        while time.monotonic() < end:
            text = tmux.screen()
            step = tmux.parse_step(text)
            if step and step[0] == n and tmux.busy(text):
                if start is None:
                    start = _ticks(pid, server)
                    spy(pid, n, args)
                elif step != seen:
                    run.steps_ms.append(step[1])
                seen, last = step, _ticks(pid, server)
            elif start is not None:
                break
            time.sleep(0.5)
    if start is not None and last is not None and last[0] > start[0]:
        wall = last[0] - start[0]
        run.cpu, run.ui_cpu, run.tmux_cpu = (tmux.cpu_seconds(last[i] - start[i]) / wall for i in (1, 2, 3))


def spy(pid: int, n: int, args: argparse.Namespace) -> None:
    if not args.pyspy:
        return
    out = Path(args.pyspy) / f"tabs{n}"
    subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--duration", str(args.pyspy_s), "--rate", "200",
                      *args.pyspy_flags.split(), "--format", "raw", "-o", f"{out}.txt"],
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def idle_cpu(pid: int, seconds: float) -> None:
    time.sleep(5)  # the last reply's end, the panels settling
    before, t0, l0 = tmux.cpu_ticks(pid), time.monotonic(), os.getloadavg()[0]
    time.sleep(seconds)
    share = tmux.cpu_seconds(tmux.cpu_ticks(pid) - before) / (time.monotonic() - t0)
    print(f"idle CPU over {seconds:.0f} s: {share:.1%} of a core (load {l0:.2f} -> {os.getloadavg()[0]:.2f})", flush=True)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tabs", default="1,4,8", help="comma list of tab counts")
    p.add_argument("--model", default=None)
    p.add_argument("--engine-args", default="", help='more engine options for the app and the engine alone, e.g. "--num-threads 1"')
    p.add_argument("--max-tokens", type=int, default=384)
    p.add_argument("--prompt", default=CHAT_PROMPT, help="what the tabs are asked")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--rounds", type=int, default=8, help="pairs of the app and the engine alone per tab count")
    p.add_argument("--port", type=int, default=8065, help="the app's endpoint (paired)")
    p.add_argument("--unpaired", action="store_true", help="one app per tab count, read off the screen")
    p.add_argument("--as-shipped", action="store_true",
                   help="the app's defaults: its built-in tools offered (their prompt, the calls' constraint) and "
                        "the KV disk tier on; by default both are off, so both sides decode the same tokens alike")
    p.add_argument("--idle", type=float, default=0, help="unpaired: seconds of idle CPU to measure after a run")
    p.add_argument("--idle-after", type=int, default=1, help="unpaired: the tab count after whose run idle CPU is read")
    p.add_argument("--pyspy", default=None, help="unpaired: folder for py-spy raw profiles (one per tab count)")
    p.add_argument("--pyspy-s", type=int, default=15)
    p.add_argument("--pyspy-flags", default="--gil --threads")
    p.add_argument("--env", action="append", help="unpaired: VAR=VALUE for the app")
    p.add_argument("--remote", default=None, help="unpaired: run the app with --backend-url URL")


def run(args: argparse.Namespace) -> dict:
    print(f"{args.model or 'default model'}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    levels = [int(x) for x in args.tabs.split(",")]
    if args.unpaired:
        if args.pyspy:
            Path(args.pyspy).mkdir(parents=True, exist_ok=True)
        rows = []
        for n in levels:
            one = unpaired(args, n)
            print(one.line(), flush=True)
            rows.append({"tabs": n, "steps_ms": one.steps_ms, "replies": one.replies, "process_cpu": one.cpu,
                         "ui_thread_cpu": one.ui_cpu, "tmux_cpu": one.tmux_cpu})
        results = {"runs": rows}
    else:
        rows = [summary_row(f"app in tmux, {n} tabs, endpoint on, /metrics 1 Hz", paired(args, n)) for n in levels]
        print("\n" + format_rows(rows))
        results = {"rows": rows}
    return results
