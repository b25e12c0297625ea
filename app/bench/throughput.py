"""`localbatch bench throughput` (and plain `localbatch bench`): offline throughput on synthetic
requests (seeded random prompt ids, EOS ignored), reported in `vllm bench` vocabulary, plus a
concurrency sweep of decode tok/s with the step split, and with `--json-schema` the cost of
grammar-constrained decoding: decode tok/s at each concurrency with every other request
constrained to the schema against the same requests unconstrained.

`localbatch bench latency`: one batch of requests end to end, `--num-iters` times; the latency's
percentiles (as `vllm bench latency`)."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from app.bench.datasets import Shape, make_requests
from app.bench.paired import alternate
from app.bench.stats import dist_ms, percentile, step_split
from app.engine.types.sampling_params import SamplingParams

if TYPE_CHECKING:
    from app.engine.core.llm_engine import LLMEngine

Progress = Callable[[str, float | None], None]
Requests = list[tuple[list[int], int]]


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
            "ttft_ms": dist_ms(self.ttft_s),
            "tpot_ms": dist_ms(self.tpot_s),
        }


def run_requests(engine: LLMEngine, requests: Requests, concurrency: int, schema: dict | None = None) -> RunResult:
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


def build_engine(args: argparse.Namespace, engine_kwargs: dict[str, Any], progress: Progress | None = None) -> LLMEngine:
    from app.engine.core.llm_engine import LLMEngine

    kw = dict(engine_kwargs)
    if getattr(args, "random_weights", None):
        kw["random_weights"] = args.random_weights
    return LLMEngine(progress=progress, **kw)


def engine_facts(engine: LLMEngine) -> dict[str, Any]:
    return {"model": engine.plan.model_name, "device": str(engine.plan.setup.device),
            "dtype": str(engine.plan.setup.dtype).removeprefix("torch."),
            "kv_cache_dtype": str(engine.plan.kv_dtype).removeprefix("torch."),
            "kv_cache_tokens": engine.stats().kv_cache_tokens}


def warm_up(engine: LLMEngine, shape: Shape, seed: int) -> None:
    """Two short requests, so the first measured step does not pay one-time costs."""
    run_requests(engine, make_requests(shape, 2, engine.plan.model_config.vocab_size, seed + 999), 2)


def concurrency_sweep(engine: LLMEngine, shape: Shape, levels: list[int], seed: int) -> list[dict]:
    """Per level c: c requests at concurrency c; decode tok/s (all decode-only steps, and those of all c
    streams), output tok/s, TTFT/TPOT p50, step split."""
    vocab, rows = engine.plan.model_config.vocab_size, []
    for c in levels:
        before = engine.stats()
        run = run_requests(engine, make_requests(shape, c, vocab, seed + c), c)
        s = run.summary()
        rows.append({"concurrency": c, "decode_tok_s": s["decode_tok_s"], "output_tok_s": s["output_tok_s"],
                     "full_batch_tok_s": round(run.full_batch_tok_s, 2),
                     "ttft_ms_p50": s["ttft_ms"]["p50"], "tpot_ms_p50": s["tpot_ms"]["p50"],
                     **step_split(before, engine.stats())})
    return rows


def run_throughput(args: argparse.Namespace, engine_kwargs: dict[str, Any], progress: Progress | None = None) -> dict:
    """The `throughput` report (results only; the caller adds the record's environment)."""
    schema = load_schema(args.json_schema) if args.json_schema else None  # a bad file fails before the load
    engine = build_engine(args, engine_kwargs, progress)
    shape = Shape.from_args(args)
    warm_up(engine, shape, args.seed)
    result = run_requests(engine, make_requests(shape, args.num_prompts, engine.plan.model_config.vocab_size, args.seed),
                          engine.config.max_num_seqs)
    report = {**engine_facts(engine), **result.summary()}
    levels = [int(x) for x in args.concurrency.split(",")] if args.concurrency else []
    if levels:
        report["sweep"] = concurrency_sweep(engine, shape, levels, args.seed)
    if schema is not None:
        report["structured"] = structured_sweep(engine, shape, levels or [8], schema, args.seed)
    return report


def run_latency(args: argparse.Namespace, engine_kwargs: dict[str, Any], progress: Progress | None = None) -> dict:
    """`--batch-size` requests at once, end to end, `--num-iters` times after `--num-iters-warmup`."""
    engine = build_engine(args, engine_kwargs, progress)
    shape, vocab = Shape.from_args(args), engine.plan.model_config.vocab_size
    for i in range(args.num_iters_warmup):
        run_requests(engine, make_requests(shape, args.batch_size, vocab, args.seed + 999 + i), args.batch_size)
    runs = [run_requests(engine, make_requests(shape, args.batch_size, vocab, args.seed + i), args.batch_size)
            for i in range(args.num_iters)]
    latencies = [r.duration_s for r in runs]
    return {**engine_facts(engine), "batch_size": args.batch_size, "iterations": args.num_iters,
            "latency_s": {"mean": round(sum(latencies) / len(latencies), 4),
                          **{f"p{q}": round(percentile(latencies, q / 100), 4) for q in (10, 25, 50, 75, 90, 99)}},
            "latencies_s": [round(x, 4) for x in latencies],
            "ttft_ms": dist_ms([t for r in runs for t in r.ttft_s]),
            "tpot_ms": dist_ms([t for r in runs for t in r.tpot_s])}


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


def structured_sweep(engine: LLMEngine, shape: Shape, levels: list[int], schema: dict, seed: int = 0,
                     repeats: int = 2) -> list[dict]:
    """Per concurrency c: 2c requests, c in flight, every other one constrained to the schema, and
    the same requests unconstrained. Decode tok/s counts only steps decoding all c streams; the two
    runs alternate `repeats` times and each keeps its best, so a burst of load elsewhere on the
    machine does not land on one side only."""
    vocab = engine.plan.model_config.vocab_size
    run_requests(engine, make_requests(shape, 2, vocab, seed + 998), 2, schema)  # compile outside the timing
    rows = []
    for c in levels:
        requests = make_requests(shape, 2 * c, vocab, seed + 2 * c)
        pairs = alternate(lambda: run_requests(engine, requests, c).full_batch_tok_s,  # noqa: B023 - run here
                          lambda: run_requests(engine, requests, c, schema).full_batch_tok_s,  # noqa: B023
                          repeats)
        base, masked = max(p[0] for p in pairs), max(p[1] for p in pairs)
        rows.append({"concurrency": c, "decode_tok_s": round(base, 2), "decode_tok_s_constrained": round(masked, 2),
                     "slowdown_pct": round(100 * (1 - masked / base), 1) if base and masked else None})
    return rows


def format_throughput(r: dict) -> str:
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
    lines += _dist_lines(r)
    for s in r.get("sweep", []):
        lines.append(f"concurrency {s['concurrency']:>4}    decode {s['decode_tok_s']:8.1f} tok/s "
                     f"({s.get('full_batch_tok_s', 0.0):.1f} all {s['concurrency']})   "
                     f"output {s['output_tok_s']:8.1f} tok/s   TTFT p50 {s['ttft_ms_p50']:.0f} ms   TPOT p50 {s['tpot_ms_p50']:.1f} ms"
                     f"   step {s['step_ms']:.2f} ms + {s['step_gap_us']:.0f} us between")
    for s in r.get("structured", []):
        slow = "n/a" if s["slowdown_pct"] is None else f"{s['slowdown_pct']:+.1f}% slower"
        lines.append(f"json schema c={s['concurrency']:<3} half constrained: decode "
                     f"{s['decode_tok_s_constrained']:8.1f} tok/s vs {s['decode_tok_s']:8.1f} unconstrained ({slow})")
    return "\n".join(lines)


def _dist_lines(r: dict) -> list[str]:
    return [f"{k.split('_')[0].upper():<8}(ms)        mean {r[k]['mean']:.1f}  p50 {r[k]['p50']:.1f}  p99 {r[k]['p99']:.1f}"
            for k in ("ttft_ms", "tpot_ms")]


def format_latency(r: dict) -> str:
    lat = r["latency_s"]
    return "\n".join([
        f"model               {r['model']} ({r['device']}, {r['dtype']})",
        f"batch               {r['batch_size']} requests, {r['iterations']} iterations",
        f"latency (s)         mean {lat['mean']:.3f}  " + "  ".join(f"p{q} {lat[f'p{q}']:.3f}" for q in (10, 50, 90, 99)),
        *_dist_lines(r),
    ])
