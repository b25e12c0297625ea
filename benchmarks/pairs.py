"""The app and `serve` against the engine alone, all kept loaded and taking turns seconds apart.

    python benchmarks/pairs.py app --tabs 1,4,8 [--model NAME] [--rounds 10] [--max-tokens 384]
    python benchmarks/pairs.py serve --streams 1,4,16 [--scrape-hz 1] [--rounds 10]

This VM's speed drifts 20-30% within minutes, so a fresh app or server against `localbatch bench`
run a minute before and after (overhead.py's sandwich) gives ratios that move ±10% a pair. Here
both sides stay loaded and alternate, the order switching each round, so each pair's two runs are
seconds apart; the side not taking its turn is stopped (SIGSTOP), so neither runs beside the other.
- engine alone: a bench worker (this file with `--worker`, in its own process), an `LLMEngine` as
  `localbatch bench` builds it, decoding N requests of `--max-tokens` tokens at concurrency N
  (greedy, as bench): against the app, N times the tabs' question through the chat template, so
  both decode the same tokens (N identical replies, whose prompt blocks the prefix cache shares:
  ~6% faster steps at 8 than N different prompts); against serve, `--prompt-len` random token
  ids, new each run, as serve_bench.py sends. Its decode tok/s and output tok/s are bench's.
- app: the app in tmux at 160x48 (tmux_tabs.py, greedy), the embedded endpoint on and `/metrics`
  scraped once a second during its turns. Each turn closes the last turn's tabs (ctrl+w), opens
  N fresh ones, types the prompt and broadcasts it (ctrl+b). The figure is the replies' tok/s as
  the app measured and stored them, summed over the tabs, against bench's decode tok/s.
- serve: `localbatch serve`, N clients streaming one request each (serve_bench.py, the same lengths,
  `--scrape-hz` scrapes of `/metrics` beside them); output tok/s against bench's output tok/s.
The first turn of each side is a warm-up, not counted (the app's: the first prefill and layouts).
Each pair prints both sides' mean step and time between steps; the summary is the median of the
pairs' ratios. Linux only (tmux, /proc, signals)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from tempfile import TemporaryDirectory
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import overhead
import tmux_tabs


@dataclass
class Turn:
    tok_s: float
    split: dict[str, float]  # step_ms, step_gap_us
    note: str = ""
    result: dict = field(default_factory=dict)  # serve: serve_bench's figures (ITL), "scrapes" (latencies, s)


@dataclass
class Pair:
    target: Turn
    bench: Turn

    @property
    def ratio(self) -> float:
        return self.target.tok_s / self.bench.tok_s


def worker(args: argparse.Namespace, engine_args: list[str]) -> None:
    """Load the engine (`engine_args`: localbatch's engine options), then per stdin line "N SEED":
    N requests at concurrency N, one JSON line back."""
    from app.bench import make_requests, run_requests, step_split
    from app.cli import add_engine_args, engine_kwargs
    from app.engine.core.llm_engine import LLMEngine

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    engine = LLMEngine(**engine_kwargs(parser.parse_args(["--model", args.model, "--device", args.device, *engine_args])))
    vocab = engine.model_config.vocab_size
    shape = SimpleNamespace(input_len=args.prompt_len, output_len=args.max_tokens, range_ratio=0.0,
                            input_range=None, output_range=None)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        n, seed = map(int, line.split())
        if args.chat_prompt:  # the app's tabs' request: one user message, through the chat template
            requests = [([{"role": "user", "content": args.chat_prompt}], args.max_tokens)] * n
        else:
            requests = make_requests(shape, n, vocab, seed)
        before = engine.stats()
        summary = run_requests(engine, requests, n).summary()
        print(json.dumps({"decode_tok_s": summary["decode_tok_s"], "output_tok_s": summary["output_tok_s"],
                          **step_split(before, engine.stats())}), flush=True)


def engine_args(args: argparse.Namespace) -> list[str]:
    """The engine options of bench and serve: overhead.py's, so a GPU run sizes both pools alike."""
    return ["--model", args.model, *overhead.device_args(args.device)]


class BenchWorker:
    """`chat_prompt`: every request is this user message (the app's tabs' request), else
    `--prompt-len` random token ids, new each run (serve_bench's and bench's requests)."""

    def __init__(self, args: argparse.Namespace, chat_prompt: str | None = None) -> None:
        cmd = [sys.executable, __file__, "--worker", "--max-tokens", str(args.max_tokens),
               "--prompt-len", str(args.prompt_len), *(["--chat-prompt", chat_prompt] if chat_prompt else []),
               *engine_args(args)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     stderr=subprocess.DEVNULL, cwd=HERE.parent)
        self._read()  # loaded
        self._seed = 1000

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the bench worker exited ({self.proc.wait()})")
        return json.loads(line)

    def run(self, n: int) -> dict:
        self._seed += 1
        self.proc.send_signal(signal.SIGCONT)
        self.proc.stdin.write(f"{n} {self._seed}\n")
        self.proc.stdin.flush()
        out = self._read()
        self.proc.send_signal(signal.SIGSTOP)
        return out

    def close(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self.proc.kill()
        self.proc.wait()


class App:
    """The app in tmux; each turn asks N fresh tabs the same question at once."""

    def __init__(self, args: argparse.Namespace, tabs: int, data: Path) -> None:
        self.tabs, self.url, self._data = tabs, f"http://127.0.0.1:{args.port}", data / "data"
        self._prompt, self._timeout = args.prompt or tmux_tabs.PROMPT, args.timeout
        targs = SimpleNamespace(model=args.model, max_tokens=args.max_tokens, remote=None, cwd=str(HERE.parent),
                                env=None, extra=["--serve", "--port", str(args.port)])
        self.pid = tmux_tabs.start_app(targs, data)
        tmux_tabs.open_tabs(tabs - 1)
        self._broadcast()  # warm-up
        os.kill(self.pid, signal.SIGSTOP)

    def turn(self) -> Turn:
        os.kill(self.pid, signal.SIGCONT)
        time.sleep(1.0)  # Textual takes the terminal back on SIGCONT: keys sent meanwhile can be lost
        self._delete_tabs()
        tmux_tabs.open_tabs(self.tabs - 1)
        time.sleep(0.8)
        before = overhead.fetch_counters(self.url)
        with overhead.Scraper(self.url, 1.0) as scraper:
            replies = self._broadcast()
        split = overhead.step_split(before, overhead.fetch_counters(self.url))
        os.kill(self.pid, signal.SIGSTOP)
        tokens = sorted(n for n, _ in replies)
        return Turn(sum(rate for _, rate in replies), split, f"replies of {tokens[0]}-{tokens[-1]} tok; {scraper.summary()}")

    def _delete_tabs(self) -> None:
        """Every tab with a reply closed (ctrl+w: the chat is kept, out of the tabs); the last one
        closed leaves a new empty tab."""
        for _ in range(2 * self.tabs + 2):
            left = len(tmux_tabs.replies(self._data))
            if not left:
                return
            tmux_tabs.tmux("send-keys", "-t", tmux_tabs.SESSION, "C-w")
            with contextlib.suppress(TimeoutError):  # the key was lost: again
                tmux_tabs.wait_for(lambda s: len(tmux_tabs.replies(self._data)) < left, 3)
        raise RuntimeError(f"{len(tmux_tabs.replies(self._data))} replies left after closing the tabs")

    def _broadcast(self) -> list[tuple[int, float]]:
        """The prompt typed and sent to every tab at once; the replies' (tokens, tok/s) once all have ended."""
        tmux_tabs.broadcast(self._prompt)
        tmux_tabs.wait_for(tmux_tabs.busy, 30)
        tmux_tabs.wait_for(lambda s: not tmux_tabs.busy(s), self._timeout)
        time.sleep(0.5)  # the replies' rows committed
        replies = tmux_tabs.replies(self._data)
        if len(replies) != self.tabs:
            raise RuntimeError(f"expected {self.tabs} replies, found {len(replies)}")
        return replies

    def close(self) -> None:
        os.kill(self.pid, signal.SIGCONT)
        tmux_tabs.tmux("send-keys", "-t", tmux_tabs.SESSION, "C-q")
        time.sleep(1.5)
        subprocess.run(["tmux", "kill-session", "-t", tmux_tabs.SESSION], check=False, capture_output=True)


class Server:
    """`localbatch serve`; each turn streams one request per client, `/metrics` scraped `hz` times a
    second beside them (0: not at all)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.url, self._args, self._seed = f"http://127.0.0.1:{args.port}", args, 0
        cmd = [sys.executable, "-m", "app.cli", "serve", *engine_args(args), "--port", str(args.port)]
        self.proc = overhead.start_server(cmd, self.url)
        self._stream(2)  # warm-up
        self.proc.send_signal(signal.SIGSTOP)

    def turn(self, clients: int, hz: float) -> Turn:
        self.proc.send_signal(signal.SIGCONT)
        time.sleep(0.5)
        before = overhead.fetch_counters(self.url)
        scraper = overhead.Scraper(self.url, 1 / hz) if hz else contextlib.nullcontext()
        with scraper:
            r = self._stream(clients)
        split = overhead.step_split(before, overhead.fetch_counters(self.url))
        self.proc.send_signal(signal.SIGSTOP)
        note = f"ITL p50 {r['itl_p50_ms']:.1f} / p99 {r['itl_p99_ms']:.1f} ms"
        if hz:
            r["scrapes"] = scraper.latencies
            note += f"; {scraper.summary()}"
        return Turn(r["output_tok_s"], split, note, r)

    def _stream(self, clients: int) -> dict:
        self._seed += 1
        return overhead.stream_level(self.url, clients, self._args, self._seed)

    def close(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self.proc.terminate()
        self.proc.wait()


def alternate(target: Callable[[], Turn], bench: Callable[[], Turn], rounds: int, label: str) -> list[Pair]:
    """`rounds` pairs, the order switching each round; prints each."""
    pairs = []
    for r in range(rounds):
        if r % 2:
            t, b = target(), bench()
        else:
            b, t = bench(), target()
        pairs.append(Pair(t, b))
        print(f"{label}, round {r}: {t.tok_s:.1f} tok/s (step {t.split['step_ms']:.2f} ms, {t.split['step_gap_us']:.0f} us "
              f"between; {t.note}), bench {b.tok_s:.1f} (step {b.split['step_ms']:.2f} ms, {b.split['step_gap_us']:.0f} us "
              f"between): {pairs[-1].ratio:.3f}", flush=True)
    return pairs


def bench_turn(worker: BenchWorker, n: int, key: str) -> Callable[[], Turn]:
    def run() -> Turn:
        out = worker.run(n)
        return Turn(out[key], out)
    return run


def measure_app(args: argparse.Namespace, tabs: int) -> list[Pair]:
    worker = BenchWorker(args, args.prompt or tmux_tabs.PROMPT)
    try:
        worker.run(tabs)  # warm-up
        with TemporaryDirectory(prefix="lbpairs") as tmp:
            app = App(args, tabs, Path(tmp))
            try:
                return alternate(app.turn, bench_turn(worker, tabs, "decode_tok_s"), args.rounds, f"app, {tabs} tabs")
            finally:
                app.close()
    finally:
        worker.close()


def measure_serve(args: argparse.Namespace, levels: list[tuple[int, float]]) -> dict[tuple[int, float], list[Pair]]:
    """Pairs at each (clients, /metrics scrapes a second) of `levels`, one server throughout."""
    worker = BenchWorker(args)
    try:
        server = Server(args)
        try:
            out = {}
            for n, hz in levels:
                worker.run(n)  # warm-up
                label = f"serve, {n} streams" + (f", /metrics at {hz:g} Hz" if hz else "")
                out[n, hz] = alternate(lambda n=n, hz=hz: server.turn(n, hz), bench_turn(worker, n, "output_tok_s"),
                                       args.rounds, label)
            return out
        finally:
            server.close()
    finally:
        worker.close()


def split_note(pairs: list[Pair]) -> str:
    """Both sides' median step and time between steps."""
    def med(side: str, key: str) -> float:
        return statistics.median(getattr(p, side).split[key] for p in pairs)
    return (f"steps {med('target', 'step_ms'):.2f} against bench's {med('bench', 'step_ms'):.2f} ms, between steps "
            f"{med('target', 'step_gap_us'):.0f} against {med('bench', 'step_gap_us'):.0f} us")


def summary(label: str, pairs: list[Pair]) -> str:
    ratios = [p.ratio for p in pairs]
    med = statistics.median
    return (f"{label}: ratio {med(ratios):.3f} (median of {len(ratios)} pairs; {', '.join(f'{x:.2f}' for x in ratios)}); "
            f"{med(p.target.tok_s for p in pairs):.1f} against bench {med(p.bench.tok_s for p in pairs):.1f} tok/s; "
            f"{split_note(pairs)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", nargs="?", choices=("app", "serve"), default="app")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tabs", default="1,4,8", help="app: comma list of tab counts")
    p.add_argument("--streams", default="1,4,16", help="serve: comma list of client counts")
    p.add_argument("--scrape-hz", type=float, default=0.0, help="serve: scrape /metrics this often during its turns")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="bench and serve (the app runs on the CPU)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=384)
    p.add_argument("--prompt-len", type=int, default=64, help="the worker's (and serve's) prompt tokens")
    p.add_argument("--prompt", default=None, help="app: what the tabs are asked (default: tmux_tabs.py's long story)")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--port", type=int, default=8065)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--chat-prompt", default=None, help=argparse.SUPPRESS)
    args, rest = p.parse_known_args()
    if args.worker:
        return worker(args, rest)
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    print(f"{args.model}, {os.cpu_count()} CPUs, load {tmux_tabs.load():.2f}, {time.strftime('%Y-%m-%d %H:%M')}",
          flush=True)
    if args.what == "app":
        lines = [summary(f"app, {n} tabs", measure_app(args, n)) for n in map(int, args.tabs.split(","))]
    else:
        runs = measure_serve(args, [(int(x), args.scrape_hz) for x in args.streams.split(",")])
        lines = [summary(f"serve, {n} streams", pairs) for (n, _), pairs in runs.items()]
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
