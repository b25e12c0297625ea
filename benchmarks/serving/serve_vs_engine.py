"""Does the HTTP server slow its engine? `localbatch serve` against the engine alone, in pairs seconds apart.

    localbatch bench research serve_vs_engine [--streams 1,4,16] [--scrape-hz 1,20] [--rounds 6]
        [--model NAME] [--device cpu|cuda] [--max-tokens 256] [--llama-server] [--llama-cpp DIR] [--json PATH]

The server and the engine alone (`app.bench.worker`, an `LLMEngine` as `localbatch bench` builds
it) both stay loaded and take turns, the order switching each round, the side not taking its turn
stopped (SIGSTOP). At each stream count the server streams one request per client
(`app.bench.stream`: random prompts of `--prompt-len` ids, `--max-tokens` each, EOS ignored) and the
engine decodes the same lengths at the same concurrency; then at one stream while `/metrics` is
scraped at each `--scrape-hz` (scrape latency reported). The figure is the server's output tok/s
against the engine's, the median of `--rounds` pairs' ratios, with both sides' step time and time
between steps (the server's from `/metrics`) and the clients' inter-token latency. With
`--llama-server`, llama-server `-np 16 -t NCPU` on the same GGUF under the same load at the
largest stream count (its ITL beside ours). On a GPU (`--device cuda`) each process gets a fixed KV
pool of 8,192 blocks, since the two share the card. The machine must be otherwise quiet."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import time

from app.bench.paired import EngineWorker, Pair, Turn, format_rows, summary_row, turns
from app.bench.server import Scraper, fetch_counters, free_port, localbatch_serve_cmd, running, start_server, stop_server
from app.bench.stats import counter_step_split, median, percentile
from app.bench.stream import Load, run_level
from ..engine_options import engine_kwargs_from_argv


class Server:
    """`localbatch serve`; each turn streams one request per client, `/metrics` scraped `hz` times
    a second beside them (0: not at all)."""

    def __init__(self, engine_argv: list[str], load: Load) -> None:
        port = free_port()
        self.url, self._load, self._seed = f"http://127.0.0.1:{port}", load, 0
        self.proc = start_server(localbatch_serve_cmd(engine_argv, port), self.url)
        self._stream(2)  # warm-up
        self.proc.send_signal(signal.SIGSTOP)

    def turn(self, clients: int, hz: float) -> Turn:
        self.proc.send_signal(signal.SIGCONT)
        time.sleep(0.5)
        before = fetch_counters(self.url)
        scraper = Scraper(self.url, 1 / hz) if hz else contextlib.nullcontext()
        with scraper:
            r = self._stream(clients)
        split = counter_step_split(before, fetch_counters(self.url))
        self.proc.send_signal(signal.SIGSTOP)
        note = f"ITL p50 {r['itl_p50_ms']:.1f} / p99 {r['itl_p99_ms']:.1f} ms"
        if isinstance(scraper, Scraper):
            r["scrapes"] = scraper.latencies
            note += f"; {scraper.summary()}"
        return Turn(r["output_tok_s"], split, note, r)

    def _stream(self, clients: int) -> dict:
        self._seed += 1
        return run_level(self.url, clients, 1, self._load, self._seed)

    def close(self) -> None:
        stop_server(self.proc)


def measure(engine_argv: list[str], load: Load, levels: list[tuple[int, float]], rounds: int) -> dict:
    """Pairs at each (clients, /metrics scrapes a second) of `levels`, one server throughout."""
    with EngineWorker(engine_kwargs_from_argv(engine_argv), load.max_tokens, load.prompt_len) as worker:
        server = Server(engine_argv, load)
        try:
            out = {}
            for n, hz in levels:
                worker.run(n)  # warm-up
                label = f"serve, {n} streams" + (f", /metrics at {hz:g} Hz" if hz else "")
                out[n, hz] = turns(lambda n=n, hz=hz: server.turn(n, hz), worker.turn(n, "output_tok_s"), rounds, label)
            return out
        finally:
            server.close()


def row(clients: int, hz: float, pairs: list[Pair]) -> dict:
    if hz:
        ms = sorted(1e3 * x for p in pairs for x in p.target.result["scrapes"])
        note = (f"{len(ms)} scrapes, p50 {median(ms):.1f} ms, p90 {percentile(ms, 0.9):.1f}, max {ms[-1]:.1f} ms"
                if ms else "no scrapes")
        return summary_row(f"serve, 1 stream, /metrics at {hz:g} Hz", pairs, note)
    note = (f"ITL p50 {median(p.target.result['itl_p50_ms'] for p in pairs):.1f} / "
            f"p99 {median(p.target.result['itl_p99_ms'] for p in pairs):.1f} ms")
    return summary_row(f"serve, {clients} streams", pairs, note)


def llama_server_row(binary: str, gguf: str, clients: int, load: Load, rounds: int) -> dict:
    """llama-server -np CLIENTS under the same load; the round with the median ITL p99."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ctx = clients * (load.prompt_len + load.max_tokens + 64)
    cmd = [binary, "-m", gguf, "--port", str(port), "-np", str(clients), "-t", str(os.cpu_count()), "-c", str(ctx),
           "--no-webui"]
    with running(cmd, url):
        run_level(url, 2, 1, load, seed=99)
        runs = sorted((run_level(url, clients, 1, load, seed=100 * i + clients) for i in range(rounds)),
                      key=lambda r: r["itl_p99_ms"])
    r = runs[len(runs) // 2]
    return {"where": f"llama-server -np {clients}, {clients} streams", "tok_s": r["output_tok_s"], "engine_tok_s": None,
            "ratio": None, "note": f"ITL p50 {r['itl_p50_ms']:.1f} / p99 {r['itl_p99_ms']:.1f} ms"}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--engine-args", default="", help='more engine options for both sides, e.g. "--num-threads 1"')
    p.add_argument("--streams", default="1,4,16", help="comma list of client counts")
    p.add_argument("--scrape-hz", default="1,20", help="also one stream with /metrics scraped at these rates ('': none)")
    p.add_argument("--rounds", type=int, default=6, help="pairs per row (medians are reported)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--llama-server", action="store_true", help="also llama.cpp's llama-server under the largest stream count")
    p.add_argument("--llama-cpp", default=None, metavar="DIR", help="the llama.cpp build (default: setup-llama-cpp's)")


def run(args: argparse.Namespace) -> dict:
    print(f"{args.model} on {args.device}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    engine_argv = ["--model", args.model, "--device", args.device,
                   *(["--kv-cache-blocks", "8192"] if args.device == "cuda" else []), *args.engine_args.split()]
    load = Load(prompt_len=args.prompt_len, max_tokens=args.max_tokens)
    streams = [int(x) for x in args.streams.split(",")]
    levels = [(n, 0.0) for n in streams] + [(1, float(hz)) for hz in args.scrape_hz.split(",") if hz.strip()]
    rows = [row(n, hz, pairs) for (n, hz), pairs in measure(engine_argv, load, levels, args.rounds).items()]
    if args.llama_server:
        from app.bench.llama_cpp import binary
        from app.engine.gguf.catalog import resolve_model

        rows.append(llama_server_row(str(binary("llama-server", args.llama_cpp)), resolve_model(args.model) or args.model,
                                     max(streams), load, args.rounds))
    print("\n" + format_rows(rows))
    return {"rows": rows}
