"""`localbatch bench serve`: streaming clients against an OpenAI-compatible server, `localbatch
serve` (started with this command's engine options) or any server at `--url` (llama-server, vLLM,
another localbatch). At each concurrency C, C clients each stream `--rounds` requests one after
another: aggregate output tok/s, TTFT and inter-token latency p50 / p99, measured at the client.
With a localbatch server, also the engine's step split over each level (from `/metrics`)."""

from __future__ import annotations

from collections.abc import Callable

from app.bench.server import fetch_counters
from app.bench.stats import counter_step_split
from app.bench.stream import Load, run_level


def run_serve(url: str, levels: list[int], rounds: int, load: Load, warmup: bool = True,
              log: Callable[[str], None] = print) -> dict:
    if warmup:
        run_level(url, min(2, max(levels)), 1, load, seed=999)
    rows = []
    for c in levels:
        before = _counters(url)
        row = run_level(url, c, rounds, load, seed=c)
        after = _counters(url)
        if before and after and after.get("steps"):
            row.update(counter_step_split(before, after))
        rows.append(row)
        log(format_row(row))
    return {"url": url, "endpoint": load.endpoint, "levels": rows}


def _counters(url: str) -> dict[str, float]:
    try:
        return fetch_counters(url)
    except OSError:  # a server without /metrics
        return {}


def format_row(r: dict) -> str:
    split = f"  step {r['step_ms']:.2f} ms + {r['step_gap_us']:.0f} us between" if "step_ms" in r else ""
    return (f"{r['concurrency']:3d} clients: {r['output_tok_s']:7.1f} tok/s  TTFT p50 {r['ttft_p50_ms']:7.1f} ms "
            f"p99 {r['ttft_p99_ms']:7.1f} ms  ITL p50 {r['itl_p50_ms']:6.1f} ms p99 {r['itl_p99_ms']:6.1f} ms{split}")
