"""`localbatch bench`: offline throughput on synthetic requests (seeded random prompt ids,
`ignore_eos`), reported in `vllm bench` vocabulary, plus a concurrency sweep of decode tok/s, and
with `--json-schema` the cost of grammar-constrained decoding: decode tok/s at each concurrency
with every other request constrained to the schema against the same requests unconstrained.

The command line adds the arguments (`add_bench_args`) and hands `run_bench` the engine settings;
this module does not import `app.cli`, and imports the engine (torch) only when a run starts, so
building the parser stays cheap."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from app.engine.types.sampling_params import SamplingParams

if TYPE_CHECKING:
    from app.engine.core.llm_engine import LLMEngine
    from app.engine.types.outputs import EngineStats


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64, help="requests in the throughput run")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (mean)")
    p.add_argument("--output-len", type=int, default=64, help="generated tokens (mean)")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)] (vllm's random-range-ratio)")
    p.add_argument("--input-range", default=None, help="MIN,MAX prompt tokens (overrides --input-len)")
    p.add_argument("--output-range", default=None, help="MIN,MAX generated tokens (overrides --output-len)")
    p.add_argument("--concurrency", default=None, help="comma list, e.g. 1,2,4,8,16: sweep decode tok/s")
    p.add_argument("--random-weights", default=None, metavar="ARCH:SIZE",
                   help="real model shapes with random weights, no file (e.g. qwen3:0.6b, llama:8b)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tui", default=None, metavar="N[,N...]",
                   help="drive the real terminal app with N tabs streaming and compare its decode tok/s "
                        "with the headless engine at concurrency N (use a long --output-len, e.g. 256)")
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="also measure structured output: decode tok/s at each --concurrency (default 8) "
                        "with half the requests constrained to this JSON schema, against none constrained")
    p.add_argument("--json", action="store_true", help="print one JSON object")


@dataclass
class RunResult:
    requests: int
    input_tokens: int
    output_tokens: int
    duration_s: float
    decode_tokens: int
    decode_time_s: float
    ttft_s: list[float]
    tpot_s: list[float]
    # Decode steps that ran every one of `concurrency` streams: comparable even when some requests
    # end early (constrained ones stop when their JSON is complete).
    full_batch_tokens: int = 0
    full_batch_time_s: float = 0.0

    @property
    def full_batch_tok_s(self) -> float:
        return self.full_batch_tokens / self.full_batch_time_s if self.full_batch_time_s else 0.0

    def summary(self) -> dict:
        return {
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "duration_s": round(self.duration_s, 3),
            "request_throughput": round(self.requests / self.duration_s, 3),
            "output_tok_s": round(self.output_tokens / self.duration_s, 2),
            "total_tok_s": round((self.input_tokens + self.output_tokens) / self.duration_s, 2),
            "decode_tok_s": round(self.decode_tokens / self.decode_time_s, 2) if self.decode_time_s else 0.0,
            "ttft_ms": _dist(self.ttft_s),
            "tpot_ms": _dist(self.tpot_s),
        }


def _dist(xs: list[float]) -> dict:
    if not xs:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    s = sorted(xs)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return {"mean": round(statistics.fmean(s) * 1e3, 2), "p50": round(pick(0.5) * 1e3, 2), "p99": round(pick(0.99) * 1e3, 2)}


def _lengths(rng: random.Random, n: int, mean: int, ratio: float, span: str | None) -> list[int]:
    lo, hi = (int(v) for v in span.split(",")) if span else (max(1, int(mean * (1 - ratio))), int(mean * (1 + ratio)))
    return [rng.randint(lo, max(lo, hi)) for _ in range(n)]


def make_requests(args: argparse.Namespace, n: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    ins = _lengths(rng, n, args.input_len, args.range_ratio, args.input_range)
    outs = _lengths(rng, n, args.output_len, args.range_ratio, args.output_range)
    return [([rng.randrange(vocab) for _ in range(i)], o) for i, o in zip(ins, outs)]


def run_requests(engine: LLMEngine, requests: list[tuple[list[int], int]], concurrency: int,
                 schema: dict | None = None) -> RunResult:
    """Keep at most `concurrency` requests in flight until all have finished. With `schema`, every
    other request is constrained to it (greedy, like the rest: it ends when its JSON does)."""
    pending = [(ids, n, schema if i % 2 == 0 else None) for i, (ids, n) in enumerate(requests)]
    live: dict[str, float] = {}
    firsts: dict[str, float] = {}
    ttft, tpot = [], []
    out_tokens = decode_tokens = full_steps = 0
    decode_time = full_time = 0.0
    start = time.perf_counter()
    while pending or live:
        while pending and len(live) < concurrency:
            ids, out_len, constraint = pending.pop(0)
            params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True, json_schema=constraint)
            seq = engine.add_request(ids, params)
            live[seq.request_id] = time.perf_counter()
        t0 = time.perf_counter()
        deltas = engine.step()
        t1 = time.perf_counter()
        last = engine.metrics.last
        if deltas and all(d.num_output_tokens > 1 for d in deltas) and last.num_tokens == last.batch_size:
            decode_time += t1 - t0
            decode_tokens += len(deltas)
            if len(deltas) == concurrency:
                full_time += t1 - t0
                full_steps += 1
        for d in deltas:
            out_tokens += len(d.token_ids)
            if d.request_id not in firsts and d.token_ids:
                firsts[d.request_id] = t1
                ttft.append(t1 - live[d.request_id])
            if d.finish_reason:
                if d.num_output_tokens > 1:
                    tpot.append((t1 - firsts[d.request_id]) / (d.num_output_tokens - 1))
                live.pop(d.request_id)
    return RunResult(len(requests), sum(len(r[0]) for r in requests), out_tokens,
                     time.perf_counter() - start, decode_tokens, decode_time, ttft, tpot,
                     full_steps * concurrency, full_time)


def step_split(before: EngineStats, after: EngineStats) -> dict[str, float]:
    """The mean step time (ms) and the mean time between a step and the next while requests were
    unfinished (µs: the host's work between steps; `serve` and the app add their hand-offs to it)."""
    gaps, steps = after.num_step_gaps - before.num_step_gaps, after.num_steps - before.num_steps
    return {"step_ms": round(1e3 * (after.total_step_time_s - before.total_step_time_s) / steps, 3) if steps else 0.0,
            "step_gap_us": round(1e6 * (after.total_step_gap_s - before.total_step_gap_s) / gaps, 1) if gaps else 0.0}


def build_engine(args: argparse.Namespace, engine_kwargs: dict[str, Any],
                 progress: Callable[[str, float | None], None] | None = None) -> LLMEngine:
    from app.engine.core.llm_engine import LLMEngine

    kw = dict(engine_kwargs)
    if args.random_weights:
        kw["random_weights"] = args.random_weights
    return LLMEngine(progress=progress, **kw)


def run_bench(args: argparse.Namespace, engine_kwargs: dict[str, Any],
              progress: Callable[[str, float | None], None] | None = None) -> int:
    """`engine_kwargs`: the engine settings from the command line (`app.cli.engine_kwargs`)."""
    if args.tui:
        return _run_tui_bench(args, engine_kwargs, progress)
    schema = load_schema(args.json_schema) if args.json_schema else None  # a bad file fails before the load
    engine = build_engine(args, engine_kwargs, progress)
    vocab = engine.model_config.vocab_size
    # Warm up so the first measured step does not pay one-time costs.
    run_requests(engine, make_requests(args, 2, vocab, args.seed + 999), 2)
    result = run_requests(engine, make_requests(args, args.num_prompts, vocab, args.seed), engine.config.max_num_seqs)
    report = {"model": engine.model_name, "device": str(engine.setup.device),
              "dtype": str(engine.setup.dtype).removeprefix("torch."),
              "kv_cache_dtype": str(engine.kv_dtype).removeprefix("torch."),
              "kv_cache_tokens": engine.stats().kv_cache_tokens,
              **result.summary()}
    if args.concurrency:
        sweep = []
        for c in (int(x) for x in args.concurrency.split(",")):
            before = engine.stats()
            r = run_requests(engine, make_requests(args, c, vocab, args.seed + c), c)
            s = r.summary()
            sweep.append({"concurrency": c, "decode_tok_s": s["decode_tok_s"], "output_tok_s": s["output_tok_s"],
                          "ttft_ms_p50": s["ttft_ms"]["p50"], "tpot_ms_p50": s["tpot_ms"]["p50"],
                          **step_split(before, engine.stats())})
        report["sweep"] = sweep
    if schema is not None:
        report["structured"] = structured_sweep(engine, args, vocab, schema)
    print(json.dumps(report, indent=None) if args.json else _format(report))
    return 0


def load_schema(path: str) -> dict:
    """The --json-schema file as a dict; a LocalbatchError saying what is wrong otherwise."""
    from app.engine.types.errors import LocalbatchError

    try:
        with open(path, encoding="utf-8") as f:
            schema = json.load(f)
    except OSError as e:
        raise LocalbatchError(f"cannot read --json-schema {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise LocalbatchError(f"--json-schema {path} is not JSON: {e.msg} at line {e.lineno}") from None
    if not isinstance(schema, dict):
        raise LocalbatchError(f"--json-schema {path} must hold a JSON object (a schema)")
    return schema


def structured_sweep(engine: LLMEngine, args: argparse.Namespace, vocab: int, schema: dict,
                     repeats: int = 2) -> list[dict]:
    """Per concurrency c: 2c requests, c in flight, every other one constrained to the schema, and
    the same requests unconstrained. Decode tok/s counts only steps decoding all c streams; the
    two runs alternate `repeats` times and each keeps its best, so a burst of load elsewhere on
    the machine does not land on one side only."""
    levels = [int(x) for x in args.concurrency.split(",")] if args.concurrency else [8]
    run_requests(engine, make_requests(args, 2, vocab, args.seed + 998), 2, schema)  # compile outside the timing
    rows = []
    for c in levels:
        requests = make_requests(args, 2 * c, vocab, args.seed + 2 * c)
        base = masked = 0.0
        for _ in range(repeats):
            base = max(base, run_requests(engine, requests, c).full_batch_tok_s)
            masked = max(masked, run_requests(engine, requests, c, schema).full_batch_tok_s)
        rows.append({"concurrency": c, "decode_tok_s": round(base, 2), "decode_tok_s_constrained": round(masked, 2),
                     "slowdown_pct": round(100 * (1 - masked / base), 1) if base and masked else None})
    return rows


def _format(r: dict) -> str:
    lines = [
        f"model               {r['model']} ({r['device']}, {r['dtype']})",
        f"KV cache            {r['kv_cache_tokens']:,} tokens ({r['kv_cache_dtype']})",
        f"requests            {r['requests']}",
        f"input tokens        {r['input_tokens']}",
        f"output tokens       {r['output_tokens']}",
        f"duration            {r['duration_s']:.2f} s",
        f"output tok/s        {r['output_tok_s']:.1f}",
        f"total tok/s         {r['total_tok_s']:.1f}",
        f"decode tok/s        {r['decode_tok_s']:.1f}",
    ]
    for k in ("ttft_ms", "tpot_ms"):
        d = r[k]
        lines.append(f"{k.split('_')[0].upper():<8}(ms)        mean {d['mean']:.1f}  p50 {d['p50']:.1f}  p99 {d['p99']:.1f}")
    for s in r.get("sweep", []):
        lines.append(f"concurrency {s['concurrency']:>4}    decode {s['decode_tok_s']:8.1f} tok/s   "
                     f"output {s['output_tok_s']:8.1f} tok/s   TTFT p50 {s['ttft_ms_p50']:.0f} ms   TPOT p50 {s['tpot_ms_p50']:.1f} ms"
                     f"   step {s['step_ms']:.2f} ms + {s['step_gap_us']:.0f} us between")
    for s in r.get("structured", []):
        slow = "n/a" if s["slowdown_pct"] is None else f"{s['slowdown_pct']:+.1f}% slower"
        lines.append(f"json schema c={s['concurrency']:<3} half constrained: decode "
                     f"{s['decode_tok_s_constrained']:8.1f} tok/s vs {s['decode_tok_s']:8.1f} unconstrained ({slow})")
    return "\n".join(lines)


def _run_tui_bench(args: argparse.Namespace, engine_kwargs: dict[str, Any],
                   progress: Callable[[str, float | None], None] | None) -> int:
    from dataclasses import asdict

    from app.tui_bench import format_tui_runs, run_tui_bench

    runs = run_tui_bench(args, engine_kwargs, progress)
    if args.json:
        print(json.dumps([{**asdict(r), "ratio": round(r.ratio, 3)} for r in runs]))
    else:
        print(format_tui_runs(runs))
    return 0
