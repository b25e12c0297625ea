"""What the app, the HTTP server and busy neighbours cost the engine, side by side in one run.

    python benchmarks/overhead.py --model smollm2-135m-instruct [--sections bench,serve,app,contention]
        [--llama-server PATH/llama-server] [--max-tokens 256] [--device cuda] [--json FILE]

Sections (each against the engine alone, as `localbatch bench` runs it, at the same concurrency):
- bench: `localbatch bench --concurrency 1,4,8,16`: output tok/s (prompt included) and decode tok/s.
- serve: `localbatch serve`, streaming /v1/completions at 1 / 4 / 16 clients (serve_bench.py), then
  at one while /metrics is scraped at 1 Hz and at 20 Hz (scrape latency reported); ITL p50/p99;
  against bench's output tok/s, the server and a bench worker kept loaded and taking turns seconds
  apart (pairs.py; `--rounds` pairs, medians of the pairs' ratios); with `--llama-server`,
  llama-server `-np 16 -t NCPU` on the same GGUF and the same 16-client load.
- app: the app in tmux at 160x48 (tmux_tabs.py) with the embedded endpoint on and /metrics scraped
  once a second: the replies' summed tok/s at 1 / 4 / 8 tabs against bench's decode tok/s, the app
  and a bench worker kept loaded and taking turns seconds apart (pairs.py; `--app-rounds` pairs,
  medians of the pairs' ratios). The tabs decode greedily, as bench does.
- contention: decode tok/s at 1 and 4 sequences with 0 and 2 `while True: pass` neighbours, fixed
  thread count against the app's adaptive one, alternated in `--contention-rounds` pairs (contention.py).
  The idle row's ratio is the median of the pairs' adaptive / fixed ratios.

The machine must be otherwise quiet (the load average is printed). Linux only (tmux, /proc)."""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from types import SimpleNamespace

import httpx

from app.clients.prometheus_text import parse_metrics

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import serve_bench

MODEL_DIR = Path.home() / ".local/share/localbatch/models"


def load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


ENGINE_ARGS: list[str] = []  # --engine-args, for bench and serve alike


def device_args(device: str) -> list[str]:
    # On a GPU, serve and bench run side by side: a fixed pool each (~3 GB for SmolLM2), not 90% of it.
    return ["--device", device] + (["--kv-cache-blocks", "8192"] if device == "cuda" else []) + ENGINE_ARGS


def run_bench(model: str, levels: list[int], max_tokens: int, prompt_len: int,
              device: str = "cpu") -> dict[int, dict]:
    cmd = [sys.executable, "-m", "app.cli", "bench", "--model", model, *device_args(device), "--num-prompts", "4",
           "--concurrency", ",".join(map(str, levels)), "--output-len", str(max_tokens),
           "--input-len", str(prompt_len), "--json"]
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE.parent)
    if run.returncode:
        raise RuntimeError(f"localbatch bench exited with {run.returncode}: {run.stderr.strip()[-2000:]}")
    out = run.stdout
    return {r["concurrency"]: r for r in json.loads(out.strip().splitlines()[-1])["sweep"]}


def fetch_counters(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)


def step_split(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean step time and mean time between busy steps (the host's hand-offs) over a stretch."""
    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    gaps, steps = delta("step_gaps"), delta("steps")
    return {"step_gap_us": 1e6 * delta("step_gap_total") / gaps if gaps else float("nan"),
            "step_ms": 1e3 * delta("step_time_total") / steps if steps else float("nan")}


class Scraper:
    """GETs /metrics every `period` s on its own thread over one kept-alive connection; keeps each
    scrape's latency. The stdlib client: httpx alone added ~1.3 ms a request on a 2-core VM, more
    than the server's answer took (Prometheus' Go client is lighter still)."""

    def __init__(self, url: str, period: float) -> None:
        self.url, self.period, self.latencies = url, period, []
        self.counters: dict[str, float] = {}  # the last scrape's series (parse_metrics)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Scraper":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        address = urllib.parse.urlsplit(self.url)
        conn = http.client.HTTPConnection(address.hostname, address.port, timeout=10)
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                conn.request("GET", "/metrics")
                response = conn.getresponse()
                body = response.read()
                if response.status == 200:
                    self.latencies.append(time.perf_counter() - t0)
                    self.counters = parse_metrics(body.decode())
            except (OSError, http.client.HTTPException):  # the app is still starting
                conn.close()
            self._stop.wait(max(0.0, self.period - (time.perf_counter() - t0)))
        conn.close()

    def summary(self) -> str:
        if not self.latencies:
            return "no scrapes"
        ms = sorted(1e3 * x for x in self.latencies)
        return f"{len(ms)} scrapes, p50 {statistics.median(ms):.1f} ms, max {ms[-1]:.1f} ms"


def start_server(cmd: list[str], url: str, timeout: float = 300) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=HERE.parent)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}")
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"{' '.join(cmd)} did not answer within {timeout:.0f} s")


def stream_level(url: str, clients: int, args: argparse.Namespace, seed: int = 0) -> dict:
    return asyncio.run(serve_bench.level(url, clients, 1, args.prompt_len, args.max_tokens, 30000, seed=seed))


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def section_bench(args: argparse.Namespace, rows: list[dict]) -> None:
    """`localbatch bench` `--rounds` times at every level of the other sections: medians."""
    levels = sorted(set(args.serve_levels) | set(args.app_levels))
    runs = [run_bench(args.model, levels, args.max_tokens, args.prompt_len, args.device) for _ in range(args.rounds)]
    for c in levels:
        out = median([b[c]["output_tok_s"] for b in runs])
        dec = median([b[c]["decode_tok_s"] for b in runs])
        rows.append({"where": f"bench, {c} seqs", "tok_s": out, "engine": out, "ratio": 1.0,
                     "note": f"decode {dec:.1f} tok/s, TPOT p50 {median([b[c]['tpot_ms_p50'] for b in runs]):.1f} ms"})


def section_serve(args: argparse.Namespace, rows: list[dict]) -> None:
    """At each level, then at one stream with /metrics scraped at 1 and at 20 Hz, `--rounds` pairs of
    `serve` and the engine alone, both kept loaded and taking turns (pairs.py); medians of the
    pairs' ratios of output tok/s."""
    import pairs  # it imports this module

    pargs = SimpleNamespace(model=args.model, device=args.device, max_tokens=args.max_tokens,
                            prompt_len=args.prompt_len, port=args.port, rounds=args.rounds)
    runs = pairs.measure_serve(pargs, [(n, 0.0) for n in args.serve_levels] + [(1, 1.0), (1, 20.0)])
    for (clients, hz), prs in runs.items():
        if hz:
            ms = sorted(1e3 * x for p in prs for x in p.target.result["scrapes"])
            where = f"serve, 1 stream, /metrics at {hz:g} Hz"
            note = f"{len(ms)} scrapes, p50 {median(ms):.1f} ms, p90 {ms[int(0.9 * len(ms))]:.1f}, max {ms[-1]:.1f} ms"
        else:
            where = f"serve, {clients} streams"
            note = (f"ITL p50 {median([p.target.result['itl_p50_ms'] for p in prs]):.1f} / "
                    f"p99 {median([p.target.result['itl_p99_ms'] for p in prs]):.1f} ms")
        rows.append({"where": where, "tok_s": median([p.target.tok_s for p in prs]),
                     "engine": median([p.bench.tok_s for p in prs]), "ratio": median([p.ratio for p in prs]),
                     "note": f"{note}; {pairs.split_note(prs)}; ratios {', '.join(f'{p.ratio:.2f}' for p in prs)}"})


def section_llama_server(args: argparse.Namespace, rows: list[dict]) -> None:
    url = f"http://127.0.0.1:{args.port + 1}"
    ctx = 16 * (args.prompt_len + args.max_tokens + 64)
    proc = start_server([args.llama_server, "-m", str(MODEL_DIR / f"{args.model}.gguf"), "--port", str(args.port + 1),
                         "-np", "16", "-t", str(os.cpu_count()), "-c", str(ctx), "--no-webui"], url)
    try:
        stream_level(url, 2, args, seed=99)
        runs = sorted((stream_level(url, 16, args, seed=100 * i + 16) for i in range(args.rounds)),
                      key=lambda r: r["itl_p99_ms"])
        r = runs[len(runs) // 2]
        rows.append({"where": "llama-server -np 16, 16 streams", "tok_s": r["output_tok_s"], "engine": None,
                     "ratio": None, "note": f"ITL p50 {r['itl_p50_ms']:.1f} / p99 {r['itl_p99_ms']:.1f} ms"})
    finally:
        proc.terminate()
        proc.wait()


def section_app(args: argparse.Namespace, rows: list[dict]) -> None:
    """At each tab count, `--app-rounds` pairs of the app and the engine alone, both kept loaded and
    taking turns (pairs.py); medians of the pairs' ratios."""
    import pairs  # it imports this module

    pargs = SimpleNamespace(model=args.model, device="cpu", max_tokens=args.max_tokens, prompt_len=args.prompt_len,
                            prompt=args.app_prompt, timeout=300, port=args.port + 2, rounds=args.app_rounds)
    for tabs in args.app_levels:
        runs = pairs.measure_app(pargs, tabs)
        last = runs[-1].target
        rows.append({"where": f"app in tmux, {tabs} tabs, endpoint on, /metrics 1 Hz",
                     "tok_s": median([p.target.tok_s for p in runs]), "engine": median([p.bench.tok_s for p in runs]),
                     "ratio": median([p.ratio for p in runs]),
                     "note": f"{pairs.split_note(runs)}; last: {last.note}; ratios {', '.join(f'{p.ratio:.2f}' for p in runs)}"})


def section_contention(args: argparse.Namespace, rows: list[dict]) -> None:
    out = subprocess.run([sys.executable, str(HERE / "contention.py"), "--model", args.model, "--neighbours", "0,2",
                          "--concurrency", "1,4", "--seconds", str(args.contention_s),
                          "--rounds", str(args.contention_rounds), "--json"],
                         check=True, capture_output=True, text=True, cwd=HERE.parent).stdout
    results = json.loads(out.strip().splitlines()[-1])
    idle = {r["seqs"]: r["fixed"] for r in results if r["neighbours"] == 0}
    for r in results:
        base = idle[r["seqs"]]
        # Idle, the rounds' paired ratios; with neighbours, against the idle fixed figure.
        ratio = r["paired_ratio"] if r["neighbours"] == 0 else r["adaptive"] / base
        rows.append({"where": f"decode, {r['seqs']} seqs, {r['neighbours']} neighbours, adaptive threads",
                     "tok_s": r["adaptive"], "engine": base, "ratio": ratio,
                     "note": f"fixed threads {r['fixed']:.1f} tok/s ({r['fixed'] / base:.2f}x); "
                             f"threads at end {r['threads_at_end']}; {args.contention_rounds} rounds"})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--sections", default="bench,serve,app,contention")
    p.add_argument("--engine-args", default="",
                   help="more engine options for bench and serve, e.g. \"--num-threads 1\"")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="for bench and serve (the app and contention run on the CPU)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--serve-levels", default="1,4,16")
    p.add_argument("--app-levels", default="1,4,8")
    p.add_argument("--app-prompt", default=None, help="what the tabs are asked (default: tmux_tabs.py's long story)")
    p.add_argument("--rounds", type=int, default=6,
                   help="bench runs, pairs of serve and bench per level, llama-server runs (medians are reported)")
    p.add_argument("--app-rounds", type=int, default=8, help="pairs of the app and bench per tab count (medians are reported)")
    p.add_argument("--contention-s", type=float, default=10.0)
    p.add_argument("--contention-rounds", type=int, default=3, help="alternated fixed / adaptive pairs per row")
    p.add_argument("--port", type=int, default=8061)
    p.add_argument("--llama-server", default=None, help="llama-server binary: its 16-stream ITL beside ours")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args()
    ENGINE_ARGS.extend(args.engine_args.split())
    args.serve_levels = [int(x) for x in args.serve_levels.split(",")]
    args.app_levels = [int(x) for x in args.app_levels.split(",")]
    sections = set(args.sections.split(","))
    print(f"{args.model} on {args.device}, {os.cpu_count()} CPUs, load {load():.2f}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    rows: list[dict] = []
    if "bench" in sections:
        section_bench(args, rows)
    if "serve" in sections:
        section_serve(args, rows)
        if args.llama_server:
            section_llama_server(args, rows)
    if "app" in sections:
        section_app(args, rows)
    if "contention" in sections:
        section_contention(args, rows)
    print("\n| where | tok/s | engine alone | ratio | notes |\n|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        engine = f"{r['engine']:.1f}" if r["engine"] is not None else "-"
        print(f"| {r['where']} | {r['tok_s']:.1f} | {engine} | {ratio} | {r['note']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
