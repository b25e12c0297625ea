"""One layer's paged KV cache as the kernels see it: the K and V pools and, for a quantized cache,
their scales. Plain torch (the CPU path imports it without Triton)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.kernels.kv_quant import SCALE_DTYPE, is_quantized_kv


# eq=False: identity semantics, like AttentionMetadata (tensors do not compare to a bool).
@dataclass(frozen=True, eq=False)
class KVCacheLayer:
    """k/v `[num_blocks, block_size, num_kv_heads, head_dim]` (vLLM's NHD) in the cache dtype;
    k_scale/v_scale `[num_blocks, block_size, num_kv_heads]` fp32 when that dtype is quantized
    (int8, fp8), else None. Slot s of a pool is row s of its `[-1, num_kv_heads, ...]` view."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_kv_cache(self.k, self.v, self.k_scale, self.v_scale)

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def scales(self) -> dict[str, torch.Tensor | None]:
        """The keyword arguments `kernels.store_kv` / `kernels.unified_attention` take."""
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}


def check_kv_cache(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> None:
    """Raise unless the pools have one 4-D shape and scales exactly when their dtype is quantized.
    Reads shapes and dtypes only (no device sync)."""
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim] of one dtype, "
            f"got {tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}"
        )
    if not is_quantized_kv(k_cache.dtype):
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"a {k_cache.dtype} KV cache takes no scales")
        return
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None or s.shape != k_cache.shape[:3] or s.dtype != SCALE_DTYPE:
            got = "None" if s is None else f"{tuple(s.shape)} {s.dtype}"
            raise ValueError(
                f"a {k_cache.dtype} KV cache needs {name} [num_blocks, block_size, num_kv_heads] "
                f"= {tuple(k_cache.shape[:3])} {SCALE_DTYPE}, got {got}"
            )
        if s.device != k_cache.device:
            raise ValueError(f"{name} is on {s.device} but the KV cache on {k_cache.device}")
