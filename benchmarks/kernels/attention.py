"""Benchmark `app.kernels.unified_attention` (Triton, paged KV) against torch's
`scaled_dot_product_attention` (contiguous KV) on the same work. CUDA only.

Cases: decode at 64 sequences x 2048 context (one query each), prefill of 4 sequences x 1024 tokens
(causal), and decode at 4 x 16384 where split-KV matters (also run with it forced off). Decode
reports achieved bandwidth: KV-cache bytes read / time.

    localbatch bench research attention [--model gemma3-270m|llama3-8b|all] [--dtype bf16|fp16] [--block-size 16]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

MODELS = {  # (query heads, KV heads, head_dim)
    "gemma3-270m": (4, 1, 256),
    "llama3-8b": (32, 8, 128),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Problem:
    name: str
    num_seqs: int
    q_len: int  # queries per sequence; the context is `context` tokens, queries last
    context: int


PROBLEMS = (
    Problem("decode 64x2048", 64, 1, 2048),
    Problem("prefill 4x1024", 4, 1024, 1024),
    Problem("decode 4x16384", 4, 1, 16384),
)


def paged_inputs(p: Problem, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int) -> dict:
    """Random paged problem (shuffled block table) plus the same K/V laid out contiguously for SDPA."""
    blocks_per_seq = -(-p.context // block_size)
    num_blocks = p.num_seqs * blocks_per_seq
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device="cuda")
    v_cache = torch.randn_like(k_cache)
    block_table = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(p.num_seqs, blocks_per_seq)
    q = torch.randn(p.num_seqs * p.q_len, heads, head_dim, dtype=dtype, device="cuda")

    def contiguous(cache: torch.Tensor) -> torch.Tensor:  # [seqs, kv_heads, context, head_dim]
        seqs = cache[block_table.long()].reshape(p.num_seqs, blocks_per_seq * block_size, kv_heads, head_dim)
        return seqs[:, : p.context].transpose(1, 2).contiguous()

    return {
        "q": q,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "out": torch.empty_like(q),
        "cu_seqlens_q": torch.arange(0, p.num_seqs + 1, device="cuda", dtype=torch.int32) * p.q_len,
        "seq_lens": torch.full((p.num_seqs,), p.context, device="cuda", dtype=torch.int32),
        "block_table": block_table,
        "sdpa_q": q.view(p.num_seqs, p.q_len, heads, head_dim).transpose(1, 2).contiguous(),
        "sdpa_k": contiguous(k_cache),
        "sdpa_v": contiguous(v_cache),
    }


def bench_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200)


def run_problem(p: Problem, model: str, dtype: torch.dtype, block_size: int) -> tuple[list[str], list[dict]]:
    from app.kernels import AttentionMetadata, unified_attention
    from app.kernels.triton_attention import triton_unified_attention

    heads, kv_heads, head_dim = MODELS[model]
    t = paged_inputs(p, heads, kv_heads, head_dim, dtype, block_size)
    scale = head_dim**-0.5
    meta = AttentionMetadata(t["cu_seqlens_q"], t["seq_lens"], t["block_table"])
    args = [t["q"], t["k_cache"], t["v_cache"], t["out"], meta]
    causal = p.q_len > 1  # the queries are the last q_len == context positions: plain causal

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            t["sdpa_q"], t["sdpa_k"], t["sdpa_v"], is_causal=causal, scale=scale, enable_gqa=heads != kv_heads
        )

    runs = {
        "unified_attention": lambda: unified_attention(*args, scale),
        "sdpa (contiguous KV)": sdpa,
    }
    if p.q_len == 1:
        runs["unified_attention, no split-KV"] = lambda: triton_unified_attention(*args, scale, num_splits=1)

    unified_attention(*args, scale)
    ref = sdpa().transpose(1, 2).reshape_as(t["out"])
    err = ((t["out"].float() - ref.float()).norm() / ref.float().norm()).item()
    kv_bytes = 2 * p.num_seqs * p.context * kv_heads * head_dim * t["k_cache"].element_size()
    flops = 4 * p.num_seqs * heads * head_dim * p.q_len * (p.context if not causal else (p.context + 1) / 2)
    lines = [f"{model:12} {p.name:15} ‖unified−sdpa‖/‖sdpa‖ = {err:.1e}"]
    rows = []
    for label, fn in runs.items():
        ms = bench_ms(fn)
        rate = f"{kv_bytes / ms / 1e6:7.0f} GB/s" if p.q_len == 1 else f"{flops / ms / 1e9:7.1f} TFLOP/s"
        lines.append(f"{'':12} {'':15} {label:32} {ms * 1e3:9.1f} us  {rate}")
        rows.append({"model": model, "case": p.name, "kernel": label, "us": round(ms * 1e3, 1), "rate": rate.strip(),
                     "rel_error": float(f"{err:.1e}")})
    return lines, rows


DEVICE = "cuda"


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=[*MODELS, "all"], default="all")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--block-size", type=int, default=16)


def run(args: argparse.Namespace) -> dict:
    from app.engine.types.errors import LocalbatchError
    from app.kernels import triton_available

    if not torch.cuda.is_available():
        raise LocalbatchError("the attention benchmark needs a CUDA GPU (torch.cuda.is_available() is False)")
    if not triton_available():
        raise LocalbatchError("the attention benchmark needs Triton (pip install triton)")
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, block_size {args.block_size}, torch {torch.__version__}")
    models = list(MODELS) if args.model == "all" else [args.model]
    rows: list[dict] = []
    for model in models:
        for p in PROBLEMS:
            lines, problem_rows = run_problem(p, model, DTYPES[args.dtype], args.block_size)
            print("\n".join(lines), flush=True)
            rows += problem_rows
    return {"gpu": torch.cuda.get_device_name(), "rows": rows}
