"""The C paged attention alone, fp32 against bf16 dot products (AVX512_BF16), on a model's shape:
a prompt's attention in chunks as the engine feeds it, and one decode row after it.

A pool of `--layers` layers' keys and values (so each call reads its layer out of cache, as in a
model), filled with random values; each timed run walks every chunk of the prompt (or one decode
row) over one layer after another. The two paths alternate run by run; the report gives the min and
median per layer and the CPU time of the process.

    localbatch bench research cpu_attention --shape qwen2.5-1.5b --context 2048,4096 --rounds 6
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from app.kernels import AttentionMetadata, cpu_attention
from app.kernels.cpu_info import cpu_model

SHAPES = {  # heads, KV heads, head size
    "qwen2.5-1.5b": (12, 2, 128),
    "qwen2.5-0.5b": (14, 2, 64),
    "smollm2-135m": (9, 3, 64),
}
BLOCK = 16


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", default="qwen2.5-1.5b", choices=list(SHAPES))
    p.add_argument("--context", default="2048,4096", help="prompt lengths (tokens)")
    p.add_argument("--chunk", type=int, default=512, help="prompt rows a call (the engine's prefill chunk)")
    p.add_argument("--kv-dtype", default="float16", choices=["float32", "float16", "int8"])
    p.add_argument("--layers", type=int, default=4, help="layers' pools to cycle through (out of cache)")
    p.add_argument("--rounds", type=int, default=6, help="alternated runs per path")
    p.add_argument("--threads", type=int, default=2)


def _pools(layers: int, tokens: int, kv_heads: int, d: int, kv_dtype: str) -> list[dict]:
    """`layers` pools of `tokens` slots in shuffled blocks, random keys and values (int8 with scales)."""
    blocks = -(-tokens // BLOCK)
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(layers):
        k, v = (torch.randn(blocks, BLOCK, kv_heads, d, generator=gen) for _ in range(2))
        pool = {"block_table": torch.randperm(blocks, generator=gen).to(torch.int32)[None]}
        if kv_dtype == "int8":
            pool.update(k=(k * 40).clamp(-127, 127).to(torch.int8), v=(v * 40).clamp(-127, 127).to(torch.int8),
                        k_scale=torch.full((blocks, BLOCK, kv_heads), 0.025), v_scale=torch.full((blocks, BLOCK, kv_heads), 0.025))
        else:
            pool.update(k=k.to(getattr(torch, kv_dtype)), v=v.to(getattr(torch, kv_dtype)))
        out.append(pool)
    return out


def _calls(context: int, chunk: int, decode: bool) -> list[tuple[int, int]]:
    """(rows, seq_len) of each call: the prompt's chunks, or one decode row at `context`."""
    if decode:
        return [(1, context)]
    return [(min(chunk, context - a), min(a + chunk, context)) for a in range(0, context, chunk)]


def _run_once(pools: list[dict], calls: list[tuple[int, int]], heads: int, d: int, bf16: bool, q: torch.Tensor,
              out: torch.Tensor) -> tuple[float, float]:
    """Wall and process CPU seconds for every call over every layer."""
    wall, cpu = time.perf_counter(), time.process_time()
    for rows, seq_len in calls:
        cu, lens = torch.tensor([0, rows], dtype=torch.int32), torch.tensor([seq_len], dtype=torch.int32)
        for pool in pools:
            meta = AttentionMetadata(cu, lens, pool["block_table"])
            scales = {n: pool[n] for n in ("k_scale", "v_scale") if n in pool}
            cpu_attention.unified_attention(q[:rows], pool["k"], pool["v"], out[:rows], meta, d**-0.5, **scales,
                                            bf16=bf16)
    return time.perf_counter() - wall, time.process_time() - cpu


def run(args: argparse.Namespace) -> dict:
    if cpu_attention.library() is None:
        raise SystemExit("the C kernels do not build here")
    if not cpu_attention.bf16_supported():
        print("this CPU lacks AVX512_BF16: the bf16 path falls back to fp32 (both columns measure fp32)")
    heads, kv_heads, d = SHAPES[args.shape]
    torch.set_num_threads(args.threads)
    rows = []
    for context in (int(c) for c in args.context.split(",")):
        pools = _pools(args.layers, context, kv_heads, d, args.kv_dtype)
        q = torch.randn(max(args.chunk, 1), heads, d)
        out = torch.empty_like(q)
        for kind in ("prompt", "decode"):
            calls = _calls(context, args.chunk, kind == "decode")
            times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
            _run_once(pools, calls, heads, d, True, q, out)  # warm: the library, the pages
            for _ in range(args.rounds):
                for bf16 in (False, True):
                    times[bf16].append(_run_once(pools, calls, heads, d, bf16, q, out))
            row = {"context": context, "kind": kind}
            for bf16, name in ((False, "fp32"), (True, "bf16")):
                walls = [w / args.layers for w, _ in times[bf16]]
                cpus = [c / args.layers for _, c in times[bf16]]
                row[name] = {"min_ms": round(min(walls) * 1e3, 3), "median_ms": round(statistics.median(walls) * 1e3, 3),
                             "cpu_median_ms": round(statistics.median(cpus) * 1e3, 3)}
            rows.append(row)
            print(f"{kind:>6} at {context:>5} tokens, ms a layer (min / median / CPU median): "
                  f"fp32 {row['fp32']['min_ms']} / {row['fp32']['median_ms']} / {row['fp32']['cpu_median_ms']}   "
                  f"bf16 {row['bf16']['min_ms']} / {row['bf16']['median_ms']} / {row['bf16']['cpu_median_ms']}")
    return {"shape": args.shape, "heads": heads, "kv_heads": kv_heads, "head_dim": d, "kv_dtype": args.kv_dtype,
            "chunk": args.chunk, "threads": args.threads, "cpu": cpu_model(), "rows": rows}
