"""Quantized KV cache storage (`kv_cache_dtype` int8 / fp8_e4m3): what a quantized slot holds and
the torch reference of how a key or value row becomes one.

Each (slot, KV head) row of K and of V is stored with its own symmetric scale: absmax / QMAX, kept
as fp32 in a `[num_blocks, block_size, num_kv_heads]` tensor paged like the data. Per-token scales
are computed as the token is stored, so nothing needs calibrating and a token's stored bytes do
not depend on what it was batched with (batch invariance holds within the quantized path). fp32,
not fp16: 4 bytes per 64-256 data bytes cost little, and fp16 would flush the scale of a tiny row
to zero or overflow on a huge one.
"""

from __future__ import annotations

import torch

SCALE_DTYPE = torch.float32

# Largest magnitude a quantized element holds: int8 keeps -128 unused so the range is symmetric;
# 448 is float8_e4m3fn's largest finite value.
KV_QUANT_MAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def is_quantized_kv(dtype: torch.dtype) -> bool:
    """True for cache dtypes stored with per-(slot, head) scales."""
    return dtype in KV_QUANT_MAX


def scale_bytes(dtype: torch.dtype) -> int:
    """Bytes of scale per (token, KV head) that K (and again V) carry in a cache of `dtype`."""
    return torch.empty((), dtype=SCALE_DTYPE).element_size() if is_quantized_kv(dtype) else 0


def quantize_kv_ref(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `[..., head_dim]` -> (`dtype` data of the same shape, fp32 scales `[...]`), with
    data * scale ~= x. int8 rounds half away from zero (what the Triton store does, in any
    backend); an all-zero row gets scale 0 and zero data."""
    qmax = KV_QUANT_MAX[dtype]
    xf = x.float()
    scale = xf.abs().amax(-1) / qmax
    y = xf / torch.where(scale > 0, scale, 1.0).unsqueeze(-1)
    if dtype == torch.int8:  # floor(|y| + 0.5) with y's sign: the Triton store's where(floor, ceil), bit for bit
        y = y.abs().add_(0.5).floor_().copysign_(y)
    # Division can land a hair past QMAX; fp8 has no inf, so an overflow would store NaN.
    return y.clamp(-qmax, qmax).to(dtype), scale


def dequantize_kv_ref(data: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """fp32 values of cache rows `[..., head_dim]` (scale `[...]`, None for an unquantized cache)."""
    if scale is None:
        return data.float()
    return data.float() * scale.unsqueeze(-1)
