"""Torch reference implementations of the attention kernels. The CPU path runs these; the Triton
kernels beside them are tested against them.

Layouts (vLLM's NHD): q/k/v/out `[num_tokens, heads, head_dim]`; caches
`[num_blocks, block_size, num_kv_heads, head_dim]`; slot = block_id * block_size + offset.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from app.kernels.metadata import AttentionMetadata


def store_kv_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write the step's new keys/values into their cache slots; slot -1 marks padding and is skipped."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping.long(), k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping.long(), v.to(v_cache.dtype))


def unified_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, meta: AttentionMetadata,
    scale: float, sliding_window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention over a packed batch that mixes prefill chunks and decodes.

    Sequence i owns query rows `cu_seqlens_q[i]:cu_seqlens_q[i+1]`; they are the LAST tokens of its
    context of `seq_lens[i]` tokens, whose keys/values (new ones included) are already in the paged
    cache. With a sliding window W the query at position p sees keys p-W < k <= p.
    """
    block_size = k_cache.shape[1]
    cu = meta.cu_seqlens_q.tolist()
    lens = meta.seq_lens.tolist()
    decodes = [i for i in range(len(lens)) if cu[i + 1] - cu[i] == 1]
    if len(decodes) == len(lens):  # a decode-only step: no row selection needed
        plan = _decode_plan(meta, None, block_size, sliding_window)
        out.copy_(_decode_attention(q, k_cache, v_cache, plan, scale, softcap))
        return out
    if decodes:
        rows = torch.tensor([cu[i] for i in decodes], device=q.device)
        plan = _decode_plan(meta, decodes, block_size, sliding_window)
        out[rows] = _decode_attention(q[rows], k_cache, v_cache, plan, scale, softcap).to(out.dtype)
    batched = set(decodes)
    for i, seq_len in enumerate(lens):
        start, end = cu[i], cu[i + 1]
        if end == start or i in batched:
            continue
        k, v = _gather_context(k_cache, v_cache, meta.block_table[i], seq_len, block_size)
        out[start:end] = _attend(q[start:end], k, v, seq_len, scale, sliding_window, softcap).to(out.dtype)
    return out


def _decode_plan(
    meta: AttentionMetadata, decodes: list[int] | None, block_size: int, sliding_window: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool rows to gather for the single-query sequences `decodes` (None: all of them), each from
    its window start, and the key mask.

    Which sequences decode depends on `meta` alone, so every layer of a step shares one plan, kept
    on `meta`, instead of making it with ~15 small ops in every layer."""
    key = ("decode_plan", block_size, sliding_window)
    if key in meta.derived:
        return meta.derived[key]
    block_table, seq_lens = meta.block_table, meta.seq_lens
    if decodes is not None:
        which = torch.tensor(decodes, device=seq_lens.device)
        block_table, seq_lens = block_table[which], seq_lens[which]
    lens = seq_lens.long()
    last_block = (lens - 1) // block_size
    first_block = torch.zeros_like(lens)
    if sliding_window is not None:
        first_block = (lens - sliding_window).clamp(min=0) // block_size
    width = int((last_block - first_block).max()) + 1
    block_idx = first_block.unsqueeze(1) + torch.arange(width, device=lens.device)  # [S, width]
    in_range = block_idx <= last_block.unsqueeze(1)
    block_idx = torch.minimum(block_idx, last_block.unsqueeze(1))
    ids = block_table.long().gather(1, block_idx).flatten()  # [S * width]
    k_pos = (block_idx.unsqueeze(2) * block_size + torch.arange(block_size, device=lens.device)).flatten(1)
    q_pos = (lens - 1).unsqueeze(1)
    mask = in_range.repeat_interleave(block_size, 1) & (k_pos <= q_pos)
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    meta.derived[key] = ids, mask
    return ids, mask


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: tuple[torch.Tensor, torch.Tensor],
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """All single-query sequences in one batched attention: one gather of their (windowed) blocks
    and one masked SDPA, instead of a gather and a kernel call per sequence. `plan`: `_decode_plan`."""
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    ids, mask = plan
    num_seqs, heads = q.shape[0], q.shape[1]
    # index_select over 2-D block rows: ~10x faster than advanced indexing of the 4-D pool on CPU.
    k = k_cache.view(k_cache.shape[0], -1).index_select(0, ids)
    v = v_cache.view(v_cache.shape[0], -1).index_select(0, ids)
    k = k.view(num_seqs, -1, kv_heads, head_dim).transpose(1, 2)  # [S, KVH, L, D]
    v = v.view(num_seqs, -1, kv_heads, head_dim).transpose(1, 2)
    # Plain batched matmuls in fp32: SDPA with a mask falls back to a slow path for one query row.
    groups = heads // kv_heads
    qh = q.float().reshape(num_seqs, kv_heads, groups, head_dim)
    scores = torch.matmul(qh, k.float().transpose(2, 3)) * scale  # [S, KVH, G, L]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    # Masked slots get weight 0; the pool holds finite values there (zero-initialised), as every
    # kernel reading whole blocks requires.
    out = torch.matmul(torch.softmax(scores, -1), v.float())  # [S, KVH, G, D]
    return out.reshape(num_seqs, heads, head_dim).to(q.dtype)


def _gather_context(
    k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor, seq_len: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    num_blocks = -(-seq_len // block_size)
    ids = blocks[:num_blocks].long()
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k = k_cache.index_select(0, ids).reshape(-1, kv_heads, head_dim)[:seq_len]
    v = v_cache.index_select(0, ids).reshape(-1, kv_heads, head_dim)[:seq_len]
    return k, v


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_len: int,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """q `[n, H, D]` are the last n positions of a context of `seq_len`; k/v `[seq_len, KVH, D]`."""
    n = q.shape[0]
    dtype = q.dtype
    q_pos = torch.arange(seq_len - n, seq_len, device=q.device).unsqueeze(1)
    k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1).to(dtype), v.transpose(0, 1).to(dtype)
    groups = qh.shape[0] // kh.shape[0]
    if softcap is None:
        out = F.scaled_dot_product_attention(
            qh.unsqueeze(0), kh.unsqueeze(0), vh.unsqueeze(0), attn_mask=mask, scale=scale, enable_gqa=groups > 1
        )[0]
        return out.transpose(0, 1)
    kh, vh = kh.repeat_interleave(groups, 0), vh.repeat_interleave(groups, 0)
    scores = torch.matmul(qh.float(), kh.float().transpose(1, 2)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, -1), vh.float()).transpose(0, 1).to(dtype)
