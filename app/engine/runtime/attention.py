"""Attention metadata of one packed step, and the paged attention call the model layers make."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app import kernels


@dataclass
class AttentionMetadata:
    """vLLM's names. Sequence i owns query rows `cu_seqlens_q[i]:cu_seqlens_q[i+1]`, the last tokens
    of a context of `seq_lens[i]` tokens whose KV lives in the blocks `block_table[i]`."""

    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including this step's tokens
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = padding

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


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
    kernels.unified_attention(
        q, k_cache, v_cache, out, meta.cu_seqlens_q, meta.seq_lens, meta.block_table, scale, sliding_window
    )
    return out
