"""Compiled Triton kernels vs the torch references on a CUDA GPU, at realistic shapes.

Skipped without CUDA. Cases and error measures are shared with the interpreter tests
(tests/kernels/test_kernels.py); here the shapes are production ones: head_dim 64-256, contexts of
thousands of tokens, prefill chunks of hundreds, the block sizes the engine uses.
"""

from __future__ import annotations

import pytest
import torch

from app import kernels
from tests.kernels.test_kernels import (
    TOLERANCE,
    AttnCase,
    attention_error,
    attention_metadata,
    make_attention_inputs,
    store_error,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# Decodes with ragged contexts, a prefill chunk after a cached prefix, a first chunk, an idle sequence.
MIXED = (1, 1, 1, 1, 300, 1, 77, 0)
MIXED_LENS = (1, 700, 1500, 2049, 1300, 3000, 77, 100)
DECODE = (1,) * 8
DECODE_LENS = (33, 512, 513, 1000, 1024, 2047, 3000, 4100)

CUDA_CASES: dict[str, AttnCase] = {
    # Gemma 3 270M: 4 query heads, 1 KV head, head_dim 256; local layers use a 512-token window.
    "gemma3-270m-local-bf16": AttnCase(
        MIXED, MIXED_LENS, heads=4, kv_heads=1, head_dim=256, dtype="bfloat16", window=512
    ),
    "gemma3-270m-global-fp16": AttnCase(MIXED, MIXED_LENS, heads=4, kv_heads=1, head_dim=256),
    "gemma3-270m-decode-bf16": AttnCase(DECODE, DECODE_LENS, heads=4, kv_heads=1, head_dim=256, dtype="bfloat16"),
    "gemma2-softcap-window": AttnCase(
        MIXED, MIXED_LENS, heads=8, kv_heads=4, head_dim=256, dtype="bfloat16", window=1024, softcap=50.0
    ),
    "gqa1-d64-bs32": AttnCase(MIXED, MIXED_LENS, heads=8, kv_heads=8, head_dim=64, block_size=32),
    "gqa2-d128-bs64-bf16": AttnCase(
        MIXED, MIXED_LENS, heads=16, kv_heads=8, head_dim=128, block_size=64, dtype="bfloat16"
    ),
    "gqa4-d128-bs16": AttnCase(MIXED, MIXED_LENS, heads=32, kv_heads=8, head_dim=128),
    "gqa8-d128-bs48": AttnCase(MIXED, MIXED_LENS, heads=16, kv_heads=2, head_dim=128, block_size=48),
    "gqa4-d128-window-short": AttnCase(MIXED, MIXED_LENS, heads=8, kv_heads=2, head_dim=128, window=100),
    "fp32-d64": AttnCase(MIXED, MIXED_LENS, heads=4, kv_heads=2, head_dim=64, dtype="float32"),
    "fp16-q-fp32-cache": AttnCase(MIXED, MIXED_LENS, heads=4, kv_heads=2, head_dim=128, cache_dtype="float32"),
    "prefill-4x1k": AttnCase((1024,) * 4, (1024,) * 4, heads=32, kv_heads=8, head_dim=128),
    "padding-tokens": AttnCase((5, 1, 0, 1), (900, 40, 7, 2000), heads=8, kv_heads=2, head_dim=128, pad_tokens=9),
    "split-auto-long-decode": AttnCase((1, 1), (9000, 16000), heads=32, kv_heads=8, head_dim=128),
    "split8-decode-window": AttnCase(
        DECODE, DECODE_LENS, heads=4, kv_heads=1, head_dim=256, window=512, launch={"num_splits": 8}
    ),
    "split4-mixed-softcap": AttnCase(
        MIXED, MIXED_LENS, heads=8, kv_heads=2, head_dim=128, softcap=30.0, launch={"num_splits": 4}
    ),
    # kv_cache_dtype int8 / fp8_e4m3 (scales per slot and KV head).
    "gemma3-270m-local-bf16-int8-kv": AttnCase(
        MIXED, MIXED_LENS, heads=4, kv_heads=1, head_dim=256, dtype="bfloat16", cache_dtype="int8", window=512
    ),
    "gqa4-d128-fp16-int8-kv": AttnCase(MIXED, MIXED_LENS, heads=32, kv_heads=8, head_dim=128, cache_dtype="int8"),
    "split8-decode-int8-kv": AttnCase(
        DECODE, DECODE_LENS, heads=4, kv_heads=1, head_dim=256, dtype="bfloat16", cache_dtype="int8",
        launch={"num_splits": 8},
    ),
    "gemma3-270m-bf16-fp8-kv": AttnCase(
        MIXED, MIXED_LENS, heads=4, kv_heads=1, head_dim=256, dtype="bfloat16", cache_dtype="float8_e4m3fn"
    ),
}

CUDA_STORE_CASES = {
    "gemma3-bf16": {"kv_heads": 1, "head_dim": 256, "dtype": "bfloat16", "cache_dtype": "bfloat16"},
    "llama-fp16": {"kv_heads": 8, "head_dim": 128, "dtype": "float16", "cache_dtype": "float16"},
    # Compiled Triton rounds fp32 -> bf16 to nearest even, like torch: bit-identical here.
    "fp32-into-bf16": {"kv_heads": 2, "head_dim": 64, "dtype": "float32", "cache_dtype": "bfloat16"},
    "fused-qkv-view": {"kv_heads": 4, "head_dim": 128, "dtype": "float16", "cache_dtype": "float16", "fused": True},
    # IEEE divisions and round-to-nearest casts: the same codes and scales as the torch reference.
    "gemma3-bf16-int8": {"kv_heads": 1, "head_dim": 256, "dtype": "bfloat16", "cache_dtype": "int8"},
    "llama-fp16-int8-fused": {"kv_heads": 8, "head_dim": 128, "dtype": "float16", "cache_dtype": "int8", "fused": True},
    "gemma3-bf16-fp8": {"kv_heads": 1, "head_dim": 256, "dtype": "bfloat16", "cache_dtype": "float8_e4m3fn"},
}


def _skip_without_fp8(cache_dtype: str | None) -> None:
    if cache_dtype == "float8_e4m3fn" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 (e4m3) needs compute capability 8.9+")


@pytest.mark.parametrize("name", list(CUDA_CASES))
def test_attention_kernel_matches_reference_on_gpu(name: str) -> None:
    from app.kernels.triton_attention import triton_unified_attention

    case = CUDA_CASES[name]
    _skip_without_fp8(case.cache_dtype)
    inputs = make_attention_inputs(case, device="cuda")

    def attention(*args, **scales):
        return triton_unified_attention(*args, **scales, **case.launch)

    err, untouched = attention_error(case, inputs, attention)
    assert err < TOLERANCE[case.dtype], err
    assert untouched, "rows outside every sequence were written"


def test_long_decode_with_few_sequences_splits_kv() -> None:
    from app.kernels.triton_attention import _default_num_splits

    q = torch.empty(2, 32, 128, device="cuda")
    assert _default_num_splits(q, num_seqs=2, num_kv_heads=8, max_keys=16384, block_n=64) > 1
    # Big decode batches and prefills already fill the GPU: no split.
    assert _default_num_splits(torch.empty(256, 32, 128, device="cuda"), 256, 8, 16384, 64) == 1
    assert _default_num_splits(torch.empty(600, 32, 128, device="cuda"), 2, 8, 16384, 64) == 1


def test_dispatch_uses_triton_on_cuda() -> None:
    from app.kernels.triton_attention import triton_unified_attention

    assert kernels.triton_available()
    case = CUDA_CASES["gqa4-d128-bs16"]
    inputs = make_attention_inputs(case, device="cuda")
    args = [inputs[n] for n in ("q", "k_cache", "v_cache")]
    meta = attention_metadata(inputs)
    out, direct = torch.zeros_like(inputs["q"]), torch.zeros_like(inputs["q"])
    kernels.unified_attention(*args, out, meta, 0.1, None, None)
    triton_unified_attention(*args, direct, meta, 0.1, None, None)
    assert torch.equal(out, direct)


@pytest.mark.parametrize("name", list(CUDA_STORE_CASES))
def test_store_kv_kernel_matches_reference_on_gpu(name: str) -> None:
    spec = dict(CUDA_STORE_CASES[name], num_tokens=700, num_blocks=64)
    _skip_without_fp8(spec["cache_dtype"])
    assert store_error(spec, kernels.store_kv, device="cuda") == 0.0
