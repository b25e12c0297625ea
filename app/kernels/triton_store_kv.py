"""Triton kernel that writes a step's new keys/values into the paged KV cache (the CUDA path).

Semantics match `app.kernels.reference.store_kv_ref`: token t goes to slot `slot_mapping[t]`
(slot = block_id * block_size + offset); slot -1 marks a padding token and is skipped. Into an
int8/fp8 cache each (token, KV head) row is quantized symmetrically with its own fp32 scale
(absmax / QMAX), written beside it (`app.kernels.kv_quant`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from app.kernels.kv_quant import KV_QUANT_MAX
from app.kernels.triton_attention import KernelLaunch


@triton.jit
def _store_rows(
    x_ptr, cache_ptr, scale_ptr, token, block, in_block,
    stride_xt, stride_xh, stride_xd, stride_cb, stride_cs, stride_ch, stride_cd, stride_sb, stride_ss, stride_sh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    QUANT_MAX: tl.constexpr, IS_INT8: tl.constexpr,
):
    """One token's K (or V) rows `[heads, head_dim]` into its slot, quantized when QUANT_MAX > 0."""
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    head_ok = heads < NUM_KV_HEADS
    mask = head_ok[:, None] & (dims < HEAD_DIM)[None, :]
    src = x_ptr + token * stride_xt + heads[:, None] * stride_xh + dims[None, :] * stride_xd
    x = tl.load(src, mask=mask, other=0.0)
    dst = cache_ptr + block * stride_cb + in_block * stride_cs + heads[:, None] * stride_ch + dims[None, :] * stride_cd
    if QUANT_MAX > 0:
        # fp32 first: the interpreter computes bf16 arithmetic wrongly, and the scale wants fp32 anyway.
        x = x.to(tl.float32)
        # IEEE divisions (plain `/` may compile to an approximate one): the same bits as torch's.
        scale = tl.math.div_rn(tl.max(tl.abs(x), 1), QUANT_MAX)  # [HEADS_PAD]; padded dims loaded as 0
        x = tl.math.div_rn(x, tl.where(scale > 0, scale, 1.0)[:, None])
        if IS_INT8:
            # Half away from zero, as the reference; the cast below then only drops a zero fraction.
            x = tl.where(x >= 0, tl.floor(x + 0.5), tl.ceil(x - 0.5))
        x = tl.minimum(tl.maximum(x, -QUANT_MAX), QUANT_MAX)
        tl.store(scale_ptr + block * stride_sb + in_block * stride_ss + heads * stride_sh, scale, mask=head_ok)
    tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
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
    stride_ksb,
    stride_kss,
    stride_ksh,
    stride_vsb,
    stride_vss,
    stride_vsh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANT_MAX: tl.constexpr,
    IS_INT8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE
    _store_rows(k_ptr, k_cache_ptr, k_scale_ptr, token, block, in_block,
                stride_kt, stride_kh, stride_kd, stride_kcb, stride_kcs, stride_kch, stride_kcd,
                stride_ksb, stride_kss, stride_ksh, NUM_KV_HEADS, HEAD_DIM, HEADS_PAD, HEAD_DIM_PAD, QUANT_MAX, IS_INT8)
    _store_rows(v_ptr, v_cache_ptr, v_scale_ptr, token, block, in_block,
                stride_vt, stride_vh, stride_vd, stride_vcb, stride_vcs, stride_vch, stride_vcd,
                stride_vsb, stride_vss, stride_vsh, NUM_KV_HEADS, HEAD_DIM, HEADS_PAD, HEAD_DIM_PAD, QUANT_MAX, IS_INT8)


def plan_store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    *, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> list[KernelLaunch]:
    """The launch `triton_store_kv` makes: one program per token (none for an empty step)."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return []
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    quant_max = KV_QUANT_MAX.get(k_cache.dtype, 0.0)
    if quant_max:
        scales = (k_scale, v_scale, *k_scale.stride(), *v_scale.stride())
    else:  # never read: QUANT_MAX == 0 compiles the scale path out
        scales = (k_cache, v_cache, 0, 0, 0, 0, 0, 0)
    args = (
        k, v, k_cache, v_cache, scales[0], scales[1], slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(), *scales[2:],
    )
    constexprs = {
        "NUM_KV_HEADS": num_kv_heads,
        "HEAD_DIM": head_dim,
        "HEADS_PAD": triton.next_power_of_2(num_kv_heads),
        "HEAD_DIM_PAD": triton.next_power_of_2(head_dim),
        "BLOCK_SIZE": block_size,
        "QUANT_MAX": quant_max,
        "IS_INT8": k_cache.dtype == torch.int8,
    }
    return [KernelLaunch(_store_kv_kernel, (num_tokens,), args, constexprs, num_stages=1)]


def triton_store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    *, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """Run `_store_kv_kernel`; same contract as `store_kv_ref`."""
    for launch in plan_store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale):
        launch()
