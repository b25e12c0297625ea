"""Attention kernels: Triton for CUDA, C for the fp32 CPU path, and the torch references beside
them (the specification, and what runs where neither applies).

The engine picks its kernels once per model (`runtime/kernel_plan.py`, through `attention_kernels`);
`unified_attention` and `store_kv` here ask the same registry (`registry.py`) per call, for callers
without a plan (tests, benchmarks). Importing this package never imports CUDA or compiles anything;
Triton kernels load lazily, the first time they are asked for.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from app.kernels import cpu_attention, registry
from app.kernels.kv_cache import KVCacheLayer, check_kv_cache
from app.kernels.kv_quant import is_quantized_kv
from app.kernels.metadata import AttentionMetadata
from app.kernels.reference import store_kv_ref, unified_attention_ref
from app.kernels.registry import AttentionRequest, triton_available
from app.kernels.settings import KernelSettings

__all__ = [
    "AttentionMetadata", "KVCacheLayer", "attention_backend", "attention_kernels", "is_quantized_kv", "store_kv", "store_kv_ref",
    "triton_available", "unified_attention", "unified_attention_ref",
]


def attention_kernels(backend: str) -> tuple[Callable, Callable]:
    """`(unified_attention, store_kv)` of the "triton" or "torch" backend, with this module's
    signatures (the C kernels have fused calls of their own: `cpu_attention`)."""
    if backend == "triton":
        from app.kernels.triton_attention import triton_unified_attention
        from app.kernels.triton_store_kv import triton_store_kv

        return triton_unified_attention, triton_store_kv
    if backend != "torch":
        raise ValueError(f"no attention kernels named {backend!r} (triton or torch)")
    return unified_attention_ref, store_kv_ref


def attention_backend(t: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor | None) -> str:
    """The registry's attention entry for a call on `t` (queries, or keys to store) over `k_cache`."""
    request = AttentionRequest(t.device.type, t.dtype, k_cache.dtype, t.shape[1], t.shape[2],
                               scales=k_scale is not None, settings=KernelSettings.from_env())
    return registry.choose("attention", request).name


def unified_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, meta: AttentionMetadata,
    scale: float, sliding_window: int | None = None, softcap: float | None = None,
    *, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged causal attention for a step mixing prefill chunks and decodes; writes and returns `out`.

    Shapes: q/out `[num_tokens, num_heads, head_dim]`; caches `[num_blocks, block_size, num_kv_heads,
    head_dim]`, with fp32 scales `[num_blocks, block_size, num_kv_heads]` when their dtype is int8
    or fp8 (`KVCacheLayer`); `meta` as `AttentionMetadata` describes (its `slot_mapping` is not
    read). Runs the Triton kernel on CUDA tensors when Triton is available, the C kernel
    (`cpu_attention`) on fp32 CPU tensors over an fp32, fp16 or int8 cache, else `unified_attention_ref`.
    """
    _check_attention_args(q, k_cache, v_cache, out, meta, sliding_window, softcap)
    check_kv_cache(k_cache, v_cache, k_scale, v_scale)
    backend = attention_backend(q, k_cache, k_scale)
    if backend == "c":
        return cpu_attention.unified_attention(q, k_cache, v_cache, out, meta, scale, sliding_window, softcap,
                                               k_scale, v_scale)
    attention = attention_kernels(backend)[0]
    return attention(q, k_cache, v_cache, out, meta, scale, sliding_window, softcap, k_scale=k_scale, v_scale=v_scale)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    *, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """Write the step's keys/values `[num_tokens, num_kv_heads, head_dim]` into their cache slots
    (slot = block_id * block_size + offset; -1 = padding, skipped), quantizing each (token, head)
    row into an int8/fp8 cache and its scale. Triton on CUDA, C for an fp32/fp16/int8 CPU cache, else torch."""
    _check_store_args(k, v, k_cache, v_cache, slot_mapping)
    check_kv_cache(k_cache, v_cache, k_scale, v_scale)
    backend = attention_backend(k, k_cache, k_scale)
    if backend == "c":
        cpu_attention.store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    attention_kernels(backend)[1](k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)


def _check_attention_args(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, meta: AttentionMetadata,
    sliding_window: int | None, softcap: float | None,
) -> None:
    # Shape/dtype checks only: nothing here reads tensor values, so no device sync.
    if q.dim() != 3 or out.shape != q.shape:
        raise ValueError(
            f"q and out must both be [num_tokens, num_heads, head_dim], got {tuple(q.shape)} and {tuple(out.shape)}"
        )
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.shape[3] != q.shape[2]:
        raise ValueError(f"head_dim of q ({q.shape[2]}) and of the KV cache ({k_cache.shape[3]}) differ")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"num_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({k_cache.shape[2]})")
    num_seqs = meta.num_seqs
    if meta.seq_lens.dim() != 1 or meta.cu_seqlens_q.shape != (num_seqs + 1,):
        raise ValueError(
            f"cu_seqlens_q must have num_seqs + 1 = {num_seqs + 1} entries, got {tuple(meta.cu_seqlens_q.shape)}"
        )
    if meta.block_table.dim() != 2 or meta.block_table.shape[0] != num_seqs:
        raise ValueError(
            f"block_table must be [num_seqs={num_seqs}, max_blocks], got {tuple(meta.block_table.shape)}"
        )
    tables = {"cu_seqlens_q": meta.cu_seqlens_q, "seq_lens": meta.seq_lens, "block_table": meta.block_table}
    for name, t in tables.items():
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    devices = {t.device for t in (q, k_cache, v_cache, out, *tables.values())}
    if len(devices) > 1:
        raise ValueError(f"all attention tensors must be on one device, got {sorted(map(str, devices))}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")


def _check_store_args(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    if k.dim() != 3 or v.shape != k.shape or k.shape[1:] != k_cache.shape[2:] or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k/v must be [num_tokens, num_kv_heads, head_dim] matching caches [num_blocks, block_size, "
            f"num_kv_heads, head_dim], got k {tuple(k.shape)}, v {tuple(v.shape)}, cache {tuple(k_cache.shape)}"
        )
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must have one slot per token ({k.shape[0]}), got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    devices = {t.device for t in (k, v, k_cache, v_cache, slot_mapping)}
    if len(devices) > 1:
        raise ValueError(f"all store_kv tensors must be on one device, got {sorted(map(str, devices))}")
