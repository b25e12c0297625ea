"""The paged attention call the model layers make: store the step's keys/values, then attend."""

from __future__ import annotations

import torch

from app import kernels
from app.kernels import AttentionMetadata, KVCacheLayer


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCacheLayer,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Store this step's k/v in the paged cache (quantizing them into an int8/fp8 one), then attend
    each query to its sequence's context."""
    kernels.store_kv(k, v, kv_cache.k, kv_cache.v, meta.slot_mapping, **kv_cache.scales)
    out = torch.empty_like(q)
    kernels.unified_attention(q, kv_cache.k, kv_cache.v, out, meta, scale, sliding_window, **kv_cache.scales)
    return out
