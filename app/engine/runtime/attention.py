"""The paged attention call the model layers make: store the step's keys/values, then attend."""

from __future__ import annotations

import torch

from app import kernels
from app.kernels import AttentionMetadata


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Store this step's k/v in the paged cache, then attend each query to its sequence's context."""
    k_cache, v_cache = kv_cache
    kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    kernels.unified_attention(q, k_cache, v_cache, out, meta, scale, sliding_window)
    return out
