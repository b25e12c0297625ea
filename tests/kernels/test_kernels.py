"""Triton kernels vs their torch references on CPU (runs in CI): results under the Triton
interpreter, plus ahead-of-time compilation of the real launches for sm_80/sm_89/sm_90 (no GPU
needed) to catch what only the compiler rejects, register spills and oversized shared memory.

Why a subprocess: `triton.jit` decides at decoration time whether a kernel is compiled or
interpreted, from TRITON_INTERPRET. Setting it in this pytest process would leak into every later
import of the kernel modules (tests/kernels/test_kernels_cuda.py must compile them for real), and it only
works if no earlier test imported them. So one child Python (this file run as a script, with
TRITON_INTERPRET=1) runs every interpreter case once and reports JSON; each parametrized test
below checks its own case in that report.

Caches start as NaN everywhere except the positions a sequence owns, so a kernel that lets any
key beyond the context, beyond the causal limit or in an unused block-table entry leak into the
softmax fails loudly (an int8 cache cannot hold NaN: its scales there are NaN instead). Shapes are
tiny: the interpreter is slow.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch

from app import kernels
from app.kernels.kv_quant import dequantize_kv_ref, is_quantized_kv, quantize_kv_ref

REPO_ROOT = Path(__file__).resolve().parents[2]
SENTINEL = 7.0  # out rows outside every sequence must keep it
TOLERANCE = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 1e-2}


@dataclass(frozen=True)
class AttnCase:
    """One random unified_attention problem; `launch` overrides the launcher's heuristics."""

    q_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    heads: int = 4
    kv_heads: int = 1
    head_dim: int = 32
    block_size: int = 16
    dtype: str = "float16"
    cache_dtype: str | None = None
    window: int | None = None
    softcap: float | None = None
    pad_tokens: int = 0
    # A hybrid KV cache: table entries before each sequence's window point at the NaN block, as
    # blocks a sliding-window group has given back would.
    freed_before_window: bool = False
    launch: dict = field(default_factory=dict, hash=False)


DECODE = (1, 1, 1, 1)
DECODE_LENS = (1, 16, 17, 45)
MIXED = (5, 1, 19, 1, 0)  # chunk after a cached prefix, decode, first chunk, decode, idle sequence
MIXED_LENS = (37, 9, 19, 64, 12)
SPLIT_LENS = (70, 33, 5)

ATTN_CASES: dict[str, AttnCase] = {
    "decode-fp32-gqa1": AttnCase(DECODE, DECODE_LENS, heads=2, kv_heads=2, dtype="float32"),
    "decode-fp16-gqa2": AttnCase(DECODE, DECODE_LENS, heads=4, kv_heads=2),
    "decode-fp16-gqa4": AttnCase(DECODE, DECODE_LENS, heads=4, kv_heads=1),
    "decode-fp16-gqa8": AttnCase(DECODE, DECODE_LENS, heads=8, kv_heads=1),
    "decode-bf16-gqa4": AttnCase(DECODE, DECODE_LENS, dtype="bfloat16"),
    "decode-gemma-d256": AttnCase((1, 1), (9, 20), heads=4, kv_heads=1, head_dim=256, window=12, softcap=30.0),
    "decode-block_m32": AttnCase(DECODE, DECODE_LENS, heads=4, kv_heads=2, launch={"block_m": 32}),
    "prefill-first-chunks": AttnCase((7, 20, 33), (7, 20, 33), heads=2, kv_heads=2, launch={"block_m": 16}),
    "prefill-default-tiles": AttnCase((70,), (70,), heads=1, kv_heads=1),
    "mixed-gqa1": AttnCase(MIXED, MIXED_LENS, heads=2, kv_heads=2),
    "mixed-gqa2": AttnCase(MIXED, MIXED_LENS, heads=4, kv_heads=2, launch={"block_m": 16}),
    "mixed-gqa4-fp32": AttnCase(MIXED, MIXED_LENS, dtype="float32", launch={"block_m": 16}),
    "mixed-gqa8-bf16": AttnCase(MIXED, MIXED_LENS, heads=8, kv_heads=1, dtype="bfloat16"),
    "mixed-gqa3": AttnCase(MIXED, MIXED_LENS, heads=6, kv_heads=2, launch={"block_m": 16}),
    "mixed-block32-tile16": AttnCase(MIXED, MIXED_LENS, block_size=32, launch={"block_n": 16}),
    "mixed-block16-tile32": AttnCase(MIXED, MIXED_LENS, block_size=16, launch={"block_n": 32}),
    "mixed-block48": AttnCase(MIXED, MIXED_LENS, block_size=48, launch={"block_n": 16}),
    "mixed-head_dim48": AttnCase(MIXED, MIXED_LENS, head_dim=48),
    "mixed-head_dim8": AttnCase(MIXED, MIXED_LENS, head_dim=8, dtype="float32"),
    "mixed-fp32-cache-fp16-q": AttnCase(MIXED, MIXED_LENS, cache_dtype="float32"),
    "window-short": AttnCase(MIXED, MIXED_LENS, window=8, launch={"block_n": 16, "block_m": 16}),
    "window-1": AttnCase(MIXED, MIXED_LENS, heads=2, kv_heads=2, window=1, launch={"block_n": 16}),
    "window-longer-than-context": AttnCase(MIXED, MIXED_LENS, window=1000),
    "softcap": AttnCase(MIXED, MIXED_LENS, heads=4, kv_heads=2, softcap=2.0),
    "softcap-window-bf16": AttnCase(MIXED, MIXED_LENS, dtype="bfloat16", window=10, softcap=5.0),
    "padding-tokens": AttnCase((3, 0, 1), (10, 4, 30), pad_tokens=3, launch={"block_m": 16}),
    "split2-decode": AttnCase((1, 1, 1), SPLIT_LENS, launch={"num_splits": 2, "block_n": 16}),
    "split8-decode-gqa8": AttnCase((1, 1, 1), SPLIT_LENS, heads=8, launch={"num_splits": 8, "block_n": 16}),
    "split4-window": AttnCase((1, 1, 1), SPLIT_LENS, window=20, launch={"num_splits": 4, "block_n": 16}),
    "split4-softcap-bf16": AttnCase(
        (1, 1, 1), SPLIT_LENS, dtype="bfloat16", softcap=3.0, launch={"num_splits": 4, "block_n": 16}
    ),
    # A decode graph's bucket: one real sequence, padding sequences of context 1, many splits mostly empty.
    "split16-graph-padding": AttnCase((1, 1, 1, 1), (40, 1, 1, 1), launch={"num_splits": 16, "block_n": 16}),
    "split2-mixed-padding": AttnCase(
        MIXED, MIXED_LENS, heads=2, kv_heads=2, pad_tokens=2, launch={"num_splits": 2, "block_n": 16}
    ),
    # kv_cache_dtype int8 / fp8_e4m3: the kernel dequantizes with per-(slot, head) scales.
    "int8-mixed-fp32": AttnCase(MIXED, MIXED_LENS, dtype="float32", cache_dtype="int8", launch={"block_m": 16}),
    "int8-mixed-bf16-gqa2": AttnCase(MIXED, MIXED_LENS, heads=4, kv_heads=2, dtype="bfloat16", cache_dtype="int8"),
    "int8-window-softcap": AttnCase(
        MIXED, MIXED_LENS, cache_dtype="int8", window=8, softcap=5.0, launch={"block_n": 16, "block_m": 16}
    ),
    "int8-split4-decode": AttnCase((1, 1, 1), SPLIT_LENS, cache_dtype="int8", launch={"num_splits": 4, "block_n": 16}),
    "int8-padding-tokens": AttnCase((3, 0, 1), (10, 4, 30), cache_dtype="int8", pad_tokens=3, launch={"block_m": 16}),
    "fp8-mixed-bf16": AttnCase(MIXED, MIXED_LENS, dtype="bfloat16", cache_dtype="float8_e4m3fn", window=10),
    # Key tiles (32) wider than blocks (8) straddle the window's start: the part before it must not
    # be read, its blocks are gone.
    "window-freed-tile32": AttnCase(
        MIXED, MIXED_LENS, block_size=8, window=12, freed_before_window=True, launch={"block_n": 32, "block_m": 16}
    ),
    "split4-window-freed": AttnCase(
        (1, 1, 1), SPLIT_LENS, block_size=8, window=20, freed_before_window=True, launch={"num_splits": 4, "block_n": 16}
    ),
    "int8-window-freed": AttnCase(
        MIXED, MIXED_LENS, block_size=4, cache_dtype="int8", window=9, freed_before_window=True, launch={"block_m": 16}
    ),
}


def make_attention_inputs(case: AttnCase, device: str = "cpu", seed: int = 0) -> dict:
    """Random inputs with shuffled block tables; unused cache slots and table entries hold NaN blocks."""
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case.dtype)
    cache_dtype = getattr(torch, case.cache_dtype or case.dtype)
    stored_dtype = cache_dtype
    if is_quantized_kv(cache_dtype):  # made in fp32 with NaN poison, then quantized
        cache_dtype = torch.float32
    bs, num_seqs = case.block_size, len(case.seq_lens)
    max_blocks = max(-(-n // bs) for n in case.seq_lens) + 1  # one spare column, like a padded table
    num_blocks = num_seqs * max_blocks + 2
    shape = (num_blocks, bs, case.kv_heads, case.head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=cache_dtype)
    v_cache = torch.full(shape, float("nan"), dtype=cache_dtype)
    poison = num_blocks - 1  # all-NaN block that unused table entries point at
    block_table = torch.full((num_seqs, max_blocks), poison, dtype=torch.int32)
    free = torch.randperm(num_blocks - 1, generator=gen).tolist()
    for i, n in enumerate(case.seq_lens):
        for j in range(-(-n // bs)):
            block = free.pop()
            block_table[i, j] = block
            used = min(bs, n - j * bs)
            k_cache[block, :used] = torch.randn(used, case.kv_heads, case.head_dim, generator=gen).to(cache_dtype)
            v_cache[block, :used] = torch.randn(used, case.kv_heads, case.head_dim, generator=gen).to(cache_dtype)
    if case.freed_before_window:
        for i, (n, q_len) in enumerate(zip(case.seq_lens, case.q_lens)):
            block_table[i, : max(0, n - q_len - case.window + 1) // bs] = poison
    num_tokens = sum(case.q_lens) + case.pad_tokens
    cu = [0]
    for n in case.q_lens:
        cu.append(cu[-1] + n)
    t = {
        "q": torch.randn(num_tokens, case.heads, case.head_dim, generator=gen).to(dtype),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "cu_seqlens_q": torch.tensor(cu, dtype=torch.int32),
        "seq_lens": torch.tensor(case.seq_lens, dtype=torch.int32),
        "block_table": block_table,
    }
    if is_quantized_kv(stored_dtype):
        t.update(quantize_poisoned(k_cache, "k", stored_dtype))
        t.update(quantize_poisoned(v_cache, "v", stored_dtype))
    return {name: x.to(device) for name, x in t.items()}


def quantize_poisoned(cache: torch.Tensor, name: str, dtype: torch.dtype) -> dict:
    """An fp32 cache with NaN poison -> `{name}_cache` (`dtype` data) and `{name}_scale`, NaN
    scales where the cache was poisoned (int8 holds no NaN; a leak still turns the output NaN)."""
    poison = cache.isnan().any(-1)
    data, scale = quantize_kv_ref(cache.nan_to_num(nan=0.0), dtype)
    scale[poison] = float("nan")
    return {f"{name}_cache": data, f"{name}_scale": scale}


def attention_metadata(inputs: dict) -> kernels.AttentionMetadata:
    return kernels.AttentionMetadata(inputs["cu_seqlens_q"], inputs["seq_lens"], inputs["block_table"])


def attention_error(case: AttnCase, inputs: dict, attention) -> tuple[float, bool]:
    """(‖out−ref‖/‖ref‖ over the sequences' rows, whether rows outside every sequence kept SENTINEL).

    The reference runs on CPU (it builds its masks there)."""
    scale = case.head_dim**-0.5
    args = [inputs[n] for n in ("q", "k_cache", "v_cache")]
    scales = {n: inputs[n] for n in ("k_scale", "v_scale") if n in inputs}
    meta = attention_metadata(inputs)
    out = torch.full_like(inputs["q"], SENTINEL)
    ref = torch.full_like(inputs["q"], SENTINEL)
    attention(*args, out, meta, scale, case.window, case.softcap, **scales)
    # The reference evaluated in fp32 on the inputs the kernel sees (caches cast to the query dtype,
    # as the reference itself does; quantized ones dequantized), so low-precision rounding is
    # counted once, in the kernel. Its caches get zeros for the NaN poison: only the kernel is
    # under test for never touching it.
    q, k_cache, v_cache = (a.cpu().to(inputs["q"].dtype).float().nan_to_num(nan=0.0) for a in args)
    if scales:
        k_cache, v_cache = (
            dequantize_kv_ref(inputs[f"{n}_cache"].cpu(), inputs[f"{n}_scale"].cpu()).nan_to_num(nan=0.0) for n in "kv"
        )
    ref = ref.cpu().float()
    kernels.unified_attention_ref(q, k_cache, v_cache, ref, meta.to("cpu"), scale, case.window, case.softcap)
    out = out.cpu().float()
    used = sum(case.q_lens)
    err = ((out[:used] - ref[:used]).norm() / ref[:used].norm()).item()
    return err, bool((out[used:] == SENTINEL).all())


STORE_CASES = {
    "fp16-padding-slots": {"kv_heads": 2, "head_dim": 32, "dtype": "float16", "cache_dtype": "float16"},
    "fp32-into-bf16-cache": {"kv_heads": 1, "head_dim": 64, "dtype": "float32", "cache_dtype": "bfloat16"},
    "kv_heads3-head_dim48": {"kv_heads": 3, "head_dim": 48, "dtype": "float32", "cache_dtype": "float32"},
    "strided-fused-qkv": {"kv_heads": 2, "head_dim": 16, "dtype": "float16", "cache_dtype": "float16", "fused": True},
    # Quantizing stores: the same int8 codes and fp32 scales as the reference, bit for bit. (fp8 is
    # left to the GPU tests: the interpreter's fp32 -> fp8 cast drops the carry into the exponent,
    # e.g. 124 -> 64 instead of 128.)
    "int8-bf16-padding-slots": {"kv_heads": 2, "head_dim": 32, "dtype": "bfloat16", "cache_dtype": "int8"},
    "int8-kv_heads3-head_dim48-fused": {
        "kv_heads": 3, "head_dim": 48, "dtype": "float32", "cache_dtype": "int8", "fused": True, "zero_row": True,
    },
}


def make_store_inputs(spec: dict, device: str = "cpu", seed: int = 0) -> dict:
    """Random k/v (optionally views into a fused qkv tensor) and a shuffled slot mapping with -1 padding."""
    gen = torch.Generator().manual_seed(seed)
    dtype, cache_dtype = getattr(torch, spec["dtype"]), getattr(torch, spec["cache_dtype"])
    kvh, d = spec["kv_heads"], spec["head_dim"]
    num_tokens, block_size = spec.get("num_tokens", 11), spec.get("block_size", 16)
    num_blocks = spec.get("num_blocks", 4)
    if spec.get("fused"):
        qkv = torch.randn(num_tokens, 4 + 2 * kvh, d, generator=gen).to(dtype)
        k, v = qkv[:, 4 : 4 + kvh], qkv[:, 4 + kvh :]
    else:
        k = torch.randn(num_tokens, kvh, d, generator=gen).to(dtype)
        v = torch.randn(num_tokens, kvh, d, generator=gen).to(dtype)
    if spec.get("zero_row"):  # an all-zero head row quantizes to scale 0, not NaN
        k[0, 0] = 0.0
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.tensor([1, 5, num_tokens - 1])] = -1
    cache_shape = (num_blocks, block_size, kvh, d)
    t = {
        "k": k,
        "v": v,
        "k_cache": torch.randn(cache_shape, generator=gen).to(cache_dtype),
        "v_cache": torch.randn(cache_shape, generator=gen).to(cache_dtype),
        "slot_mapping": slots,
    }
    if is_quantized_kv(cache_dtype):  # random prior contents: slots not stored to must keep them
        t["k_scale"] = torch.rand(cache_shape[:3], generator=gen)
        t["v_scale"] = torch.rand(cache_shape[:3], generator=gen)
    return {name: x.to(device) for name, x in t.items()}


def store_error(spec: dict, store, device: str = "cpu") -> float:
    """Largest |cache − reference cache| relative to the reference (0.0 when bit-identical); for a
    quantized cache, over its dequantized values and its scales."""
    inputs = make_store_inputs(spec, device)
    names = [n for n in ("k_cache", "v_cache", "k_scale", "v_scale") if n in inputs]
    ref = {n: inputs[n].cpu().clone() for n in names}
    scales = {n: inputs[n] for n in ("k_scale", "v_scale") if n in inputs}
    store(inputs["k"], inputs["v"], inputs["k_cache"], inputs["v_cache"], inputs["slot_mapping"], **scales)
    ref_scales = {n: ref[n] for n in scales}
    kernels.store_kv_ref(
        inputs["k"].cpu(), inputs["v"].cpu(), ref["k_cache"], ref["v_cache"], inputs["slot_mapping"].cpu(), **ref_scales
    )
    got = {n: inputs[n].cpu() for n in names}
    if scales:
        pairs = [(dequantize_kv_ref(got[f"{x}_cache"], got[f"{x}_scale"]),
                  dequantize_kv_ref(ref[f"{x}_cache"], ref[f"{x}_scale"])) for x in "kv"]
        pairs += [(got[n], ref[n]) for n in scales]
    else:
        pairs = [(got[n].float(), ref[n].float()) for n in names]
    return max(((c - r).abs() / r.abs().clamp_min(1e-6)).max().item() for c, r in pairs)


def _run_interpreter_cases() -> dict:
    """Child-process entry: run every case through the interpreted kernels."""
    from app.kernels.triton_attention import triton_unified_attention
    from app.kernels.triton_store_kv import triton_store_kv

    results = {}
    for name, case in ATTN_CASES.items():
        try:
            launch = case.launch

            def attention(*args, **scales):
                return triton_unified_attention(*args, **scales, **launch)

            err, untouched = attention_error(case, make_attention_inputs(case), attention)
            results[f"attn/{name}"] = {"err": err, "untouched": untouched}
        except Exception:  # report, so the other cases still run
            results[f"attn/{name}"] = {"error": traceback.format_exc()}
    for name, spec in STORE_CASES.items():
        try:
            results[f"store/{name}"] = {"err": store_error(spec, triton_store_kv)}
        except Exception:
            results[f"store/{name}"] = {"error": traceback.format_exc()}
    return results


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    path = os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    worker = [sys.executable, str(Path(__file__).resolve())]
    proc = subprocess.run(worker, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        pytest.fail(f"interpreter worker exited with {proc.returncode}:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(ATTN_CASES))
def test_attention_kernel_matches_reference(interpreter_results: dict, name: str) -> None:
    result = interpreter_results[f"attn/{name}"]
    assert "error" not in result, result.get("error")
    assert result["err"] < TOLERANCE[ATTN_CASES[name].dtype], result
    assert result["untouched"], "rows outside every sequence were written"


@pytest.mark.parametrize("name", list(STORE_CASES))
def test_store_kv_kernel_matches_reference(interpreter_results: dict, name: str) -> None:
    result = interpreter_results[f"store/{name}"]
    assert "error" not in result, result.get("error")
    spec = STORE_CASES[name]
    # The interpreter rounds fp32 -> bf16 toward zero (compiled Triton and torch round to nearest
    # even): allow one bf16 ulp there; same-dtype copies and int8 quantization must be exact.
    exact = spec["dtype"] == spec["cache_dtype"] or spec["cache_dtype"] == "int8"
    assert result["err"] <= (0.0 if exact else 2.0**-7), result


# Compiling for real GPU targets needs no GPU: it catches what the interpreter accepts but the
# compiler rejects, register spills, and shared memory beyond what a consumer GPU gives one block.
SM89_SHARED_BYTES = 99 * 1024
MAX_SPILL_BYTES = 64  # a few spilled registers cost little; hundreds (an oversized tile) cost a lot
TRITON_TYPES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.int8: "i8",
    torch.float8_e4m3fn: "fp8e4nv",
}
COMPILE_CASES = {
    "gemma3-decode-bf16-window": (AttnCase((1,) * 8, (1,) * 8, head_dim=256, dtype="bfloat16", window=512), (89, 80)),
    "gemma3-prefill-bf16": (AttnCase((512,), (600,), head_dim=256, dtype="bfloat16"), (89, 90)),
    "gemma3-decode-split8": (AttnCase((1, 1), (1, 1), head_dim=256, launch={"num_splits": 8}), (89,)),
    "llama-decode-fp16": (AttnCase((1,) * 8, (1,) * 8, heads=32, kv_heads=8, head_dim=128), (89,)),
    # What a decode CUDA graph of a small batch captures: the table is max_model_len wide, so split-KV.
    "llama-graph-decode-split16-bf16": (
        AttnCase((1,) * 2, (1,) * 2, heads=32, kv_heads=8, head_dim=128, dtype="bfloat16", launch={"num_splits": 16}),
        (89, 90),
    ),
    "llama-prefill-fp16-softcap": (
        AttnCase((512,), (600,), heads=32, kv_heads=8, head_dim=128, softcap=30.0),
        (89, 90),
    ),
    "prefill-fp32": (AttnCase((512,), (600,), heads=8, kv_heads=2, head_dim=128, dtype="float32"), (89,)),
    "prefill-fp16-q-fp32-cache": (
        AttnCase((512,), (600,), heads=8, kv_heads=2, head_dim=128, cache_dtype="float32"),
        (89,),
    ),
    "prefill-d64-bs32": (AttnCase((512,), (600,), heads=8, kv_heads=8, head_dim=64, block_size=32), (89,)),
    "gemma3-decode-int8-kv": (
        AttnCase((1,) * 8, (1,) * 8, head_dim=256, dtype="bfloat16", cache_dtype="int8", window=512), (80, 89, 90)
    ),
    "llama-prefill-int8-kv": (
        AttnCase((512,), (600,), heads=32, kv_heads=8, head_dim=128, dtype="bfloat16", cache_dtype="int8"), (80, 89)
    ),
    "llama-graph-decode-split16-int8-kv": (
        AttnCase((1,) * 2, (1,) * 2, heads=32, kv_heads=8, head_dim=128, cache_dtype="int8", launch={"num_splits": 16}),
        (89,),
    ),
    # fp8 (e4m3) converts natively from sm_89 on; the engine refuses it on older GPUs.
    "gemma3-decode-fp8-kv": (
        AttnCase((1,) * 8, (1,) * 8, head_dim=256, dtype="bfloat16", cache_dtype="float8_e4m3fn"), (89, 90)
    ),
    "llama-prefill-fp8-kv": (
        AttnCase((512,), (600,), heads=32, kv_heads=8, head_dim=128, dtype="bfloat16", cache_dtype="float8_e4m3fn"),
        (89, 90),
    ),
}


def meta_attention_inputs(case: AttnCase) -> dict:
    """Shape-only ("meta") tensors: enough to plan a launch, nothing allocated."""
    dtype, cache_dtype = getattr(torch, case.dtype), getattr(torch, case.cache_dtype or case.dtype)
    num_seqs, num_tokens = len(case.q_lens), sum(case.q_lens)
    cache_shape = (1024, case.block_size, case.kv_heads, case.head_dim)
    meta = {"device": "meta"}
    t = {
        "q": torch.empty(num_tokens, case.heads, case.head_dim, dtype=dtype, **meta),
        "k_cache": torch.empty(cache_shape, dtype=cache_dtype, **meta),
        "v_cache": torch.empty(cache_shape, dtype=cache_dtype, **meta),
        "out": torch.empty(num_tokens, case.heads, case.head_dim, dtype=dtype, **meta),
        "cu_seqlens_q": torch.empty(num_seqs + 1, dtype=torch.int32, **meta),
        "seq_lens": torch.empty(num_seqs, dtype=torch.int32, **meta),
        "block_table": torch.empty(num_seqs, 256, dtype=torch.int32, **meta),
    }
    if is_quantized_kv(cache_dtype):
        t["k_scale"] = torch.empty(cache_shape[:3], dtype=torch.float32, **meta)
        t["v_scale"] = torch.empty(cache_shape[:3], dtype=torch.float32, **meta)
    return t


def compile_launch(launch, arch: int):
    """Compile one planned launch for sm_<arch>, specializing arguments as a real launch does:
    ints equal to 1 become constants; tensors and multiples of 16 get divisibility hints."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs = {}, dict(launch.constexprs), {}
    for i, (name, value) in enumerate(zip(launch.kernel.arg_names, launch.args)):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + TRITON_TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1:
            constexprs[name] = 1
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    signature.update({name: "constexpr" for name in constexprs})
    src = ASTSource(launch.kernel, signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def local_memory_bytes(compiled) -> int | None:
    """Per-thread local memory (register spills) from the cubin, or None without cuobjdump."""
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    match = re.search(r"STACK:(\d+)", usage)
    return int(match.group(1)) if match else None


@pytest.fixture(scope="module")
def compiled_kernels():
    """The kernel modules compiled for real (not interpreted); skips where Triton cannot target CUDA."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError:
        pytest.skip("this Triton has no ASTSource/GPUTarget to compile ahead of time")
    from app.kernels import triton_attention, triton_store_kv

    if triton_attention._is_interpreted(triton_attention._unified_attention_kernel):
        pytest.skip("TRITON_INTERPRET is set in this process")
    return triton_attention, triton_store_kv


@pytest.mark.parametrize("name", list(COMPILE_CASES))
def test_attention_compiles_for_gpu_targets(compiled_kernels, name: str) -> None:
    triton_attention, _ = compiled_kernels
    case, archs = COMPILE_CASES[name]
    t = meta_attention_inputs(case)
    args = [t[n] for n in ("q", "k_cache", "v_cache", "out")]
    scales = {n: t[n] for n in ("k_scale", "v_scale") if n in t}
    plan = triton_attention.plan_unified_attention(
        *args, attention_metadata(t), 0.1, case.window, case.softcap, **scales, **case.launch
    )
    for launch in plan:
        for arch in archs:
            compiled = compile_launch(launch, arch)
            assert compiled.metadata.shared <= SM89_SHARED_BYTES, (arch, compiled.metadata.shared)
            assert (local_memory_bytes(compiled) or 0) <= MAX_SPILL_BYTES, f"register spills on sm_{arch}"


@pytest.mark.parametrize(
    ("kv_heads", "head_dim", "dtype", "cache_dtype"),
    [
        (1, 256, torch.bfloat16, torch.bfloat16),
        (8, 128, torch.float16, torch.float16),
        (3, 80, torch.float32, torch.float32),
        (1, 256, torch.bfloat16, torch.int8),
        (8, 128, torch.bfloat16, torch.float8_e4m3fn),
    ],
)
def test_store_kv_compiles_for_gpu_targets(compiled_kernels, kv_heads, head_dim, dtype, cache_dtype) -> None:
    _, triton_store_kv = compiled_kernels
    kv = torch.empty(64, kv_heads, head_dim, dtype=dtype, device="meta")
    cache = torch.empty(128, 16, kv_heads, head_dim, dtype=cache_dtype, device="meta")
    slots = torch.empty(64, dtype=torch.int64, device="meta")
    scales = {}
    if is_quantized_kv(cache_dtype):
        scale = torch.empty(128, 16, kv_heads, dtype=torch.float32, device="meta")
        scales = {"k_scale": scale, "v_scale": scale}
    (launch,) = triton_store_kv.plan_store_kv(kv, kv, cache, cache, slots, **scales)
    assert (local_memory_bytes(compile_launch(launch, 89)) or 0) == 0


def test_import_is_lazy() -> None:
    code = (
        "import sys, torch, app.kernels, app.engine.core.llm_engine, app.cli, app.bench; "
        "assert 'triton' not in sys.modules; assert not torch.cuda.is_initialized()"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True, timeout=120)


@pytest.mark.parametrize("name", ["mixed-gqa2", "softcap-window-bf16", "padding-tokens"])
def test_cpu_dispatch_is_the_reference(name: str) -> None:
    case, inputs = ATTN_CASES[name], make_attention_inputs(ATTN_CASES[name])
    args = [inputs[n].nan_to_num(nan=0.0) for n in ("q", "k_cache", "v_cache")]
    out, ref = torch.full_like(inputs["q"], SENTINEL), torch.full_like(inputs["q"], SENTINEL)
    kernels.unified_attention(*args, out, attention_metadata(inputs), 0.25, case.window, case.softcap)
    kernels.unified_attention_ref(*args, ref, attention_metadata(inputs), 0.25, case.window, case.softcap)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("name", ["window-freed-tile32", "split4-window-freed", "int8-window-freed"])
def test_reference_reads_nothing_before_the_window(name: str) -> None:
    """The CPU path attends with the NaN blocks a hybrid KV cache freed still in the table: the
    rows are those of the same cache with the freed entries intact."""
    case = ATTN_CASES[name]
    freed = make_attention_inputs(case)
    intact = make_attention_inputs(replace(case, freed_before_window=False))
    outs = []
    for inputs in (freed, intact):
        # Finite everywhere but in the poison block (the last one), which freed entries point at.
        q, k, v = inputs["q"].float(), inputs["k_cache"].nan_to_num(nan=0.0), inputs["v_cache"].nan_to_num(nan=0.0)
        scales = {n: inputs[n].nan_to_num(nan=1.0) for n in ("k_scale", "v_scale") if n in inputs}
        for poisoned in scales.values() if scales else (k, v):
            poisoned[-1] = float("nan")
        out = torch.full_like(q, SENTINEL)
        kernels.unified_attention(q, k, v, out, attention_metadata(inputs), 0.25, case.window, case.softcap, **scales)
        outs.append(out[: sum(case.q_lens)])
    assert not outs[0].isnan().any()
    assert torch.equal(outs[0], outs[1])


def test_cpu_store_dispatch_is_the_reference() -> None:
    assert store_error(STORE_CASES["fp16-padding-slots"], kernels.store_kv) == 0.0


def _attention_args(**overrides) -> list:
    t = {
        "q": torch.zeros(3, 4, 32),
        "k_cache": torch.zeros(4, 16, 2, 32),
        "v_cache": torch.zeros(4, 16, 2, 32),
        "out": torch.zeros(3, 4, 32),
        "cu_seqlens_q": torch.tensor([0, 2, 3], dtype=torch.int32),
        "seq_lens": torch.tensor([2, 5], dtype=torch.int32),
        "block_table": torch.zeros(2, 2, dtype=torch.int32),
    }
    t.update(overrides)
    return [t["q"], t["k_cache"], t["v_cache"], t["out"], attention_metadata(t)]


@pytest.mark.parametrize(
    ("overrides", "kwargs", "error"),
    [
        ({"q": torch.zeros(3, 4, 16)}, {}, "head_dim"),
        ({"q": torch.zeros(3, 3, 32), "out": torch.zeros(3, 3, 32)}, {}, "multiple of num_kv_heads"),
        ({"out": torch.zeros(2, 4, 32)}, {}, "q and out"),
        ({"cu_seqlens_q": torch.tensor([0, 3], dtype=torch.int32)}, {}, "num_seqs + 1"),
        ({"block_table": torch.zeros(3, 2, dtype=torch.int32)}, {}, "block_table"),
        ({"seq_lens": torch.tensor([2.0, 5.0])}, {}, "int32 or int64"),
        ({}, {"sliding_window": 0}, "sliding_window"),
        ({}, {"softcap": -1.0}, "softcap"),
    ],
)
def test_attention_rejects_bad_arguments(overrides: dict, kwargs: dict, error: str) -> None:
    with pytest.raises((ValueError, TypeError), match=re.escape(error)):
        kernels.unified_attention(*_attention_args(**overrides), 1.0, **kwargs)


def test_store_kv_rejects_mismatched_slots() -> None:
    k = torch.zeros(3, 2, 32)
    with pytest.raises(ValueError, match="one slot per token"):
        kernels.store_kv(k, k, torch.zeros(4, 16, 2, 32), torch.zeros(4, 16, 2, 32), torch.zeros(2, dtype=torch.int64))


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported
    print(json.dumps(_run_interpreter_cases()))
