"""Triton kernel that writes a step's new keys/values into the paged KV cache (the CUDA path).

Semantics match `app.kernels.reference.store_kv_ref`: token t goes to slot `slot_mapping[t]`
(slot = block_id * block_size + offset); slot -1 marks a padding token and is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from app.kernels.triton_attention import KernelLaunch


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)

    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + in_block * stride_kcs + heads * stride_kch + dims * stride_kcd
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask)
    v_dst = v_cache_ptr + block * stride_vcb + in_block * stride_vcs + heads * stride_vch + dims * stride_vcd
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def plan_store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> list[KernelLaunch]:
    """The launch `triton_store_kv` makes: one program per token (none for an empty step)."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return []
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    args = (k, v, k_cache, v_cache, slot_mapping, *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride())
    constexprs = {
        "NUM_KV_HEADS": num_kv_heads,
        "HEAD_DIM": head_dim,
        "HEADS_PAD": triton.next_power_of_2(num_kv_heads),
        "HEAD_DIM_PAD": triton.next_power_of_2(head_dim),
        "BLOCK_SIZE": block_size,
    }
    return [KernelLaunch(_store_kv_kernel, (num_tokens,), args, constexprs, num_stages=1)]


def triton_store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Run `_store_kv_kernel`; same contract as `store_kv_ref`."""
    for launch in plan_store_kv(k, v, k_cache, v_cache, slot_mapping):
        launch()
