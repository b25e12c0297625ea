"""Torch reference implementations of the attention kernels. The CPU path runs these; the Triton
kernels beside them are tested against them.

Layouts (vLLM's NHD): q/k/v/out `[num_tokens, heads, head_dim]`; caches
`[num_blocks, block_size, num_kv_heads, head_dim]`; slot = block_id * block_size + offset.
A quantized cache (int8 / fp8, `kv_quant`) comes with fp32 scales `[num_blocks, block_size,
num_kv_heads]` for K and for V; an unquantized one with none.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from app.kernels.kv_cache import KVCacheLayer
from app.kernels.kv_quant import dequantize_kv_ref, quantize_kv_ref
from app.kernels.metadata import AttentionMetadata


def store_kv_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    *, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """Write the step's new keys/values into their cache slots; slot -1 marks padding and is skipped.
    A quantized cache stores each (token, head) row quantized and its scale beside it."""
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
    slots = slot_mapping.long()
    if k_scale is None:
        _store_rows(k.to(k_cache.dtype), k_cache, slots)
        _store_rows(v.to(v_cache.dtype), v_cache, slots)
        return
    # K and V quantized as one tensor: half the small ops, which dominate a decode step's store.
    data, scales = quantize_kv_ref(torch.stack((k, v)), k_cache.dtype)
    for cache, scale, rows, row_scales in ((k_cache, k_scale, data[0], scales[0]), (v_cache, v_scale, data[1], scales[1])):
        _store_rows(rows, cache, slots)
        scale.view(-1, cache.shape[2]).index_copy_(0, slots, row_scales)


def _store_rows(rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    _bits(cache).view(-1, cache.shape[2], cache.shape[3]).index_copy_(0, slots, _bits(rows))


def _bits(t: torch.Tensor) -> torch.Tensor:
    # index_copy_ has no fp8 kernel on the CPU; moving the bytes as uint8 is the same copy.
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def unified_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, meta: AttentionMetadata,
    scale: float, sliding_window: int | None = None, softcap: float | None = None,
    *, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention over a packed batch that mixes prefill chunks and decodes.

    Sequence i owns query rows `cu_seqlens_q[i]:cu_seqlens_q[i+1]`; they are the LAST tokens of its
    context of `seq_lens[i]` tokens, whose keys/values (new ones included) are already in the paged
    cache. With a sliding window W the query at position p sees keys p-W < k <= p. A quantized
    cache is attended as its dequantized values (data * scale).
    """
    block_size = k_cache.shape[1]
    cu = meta.cu_seqlens_q.tolist()
    lens = meta.seq_lens.tolist()
    cache = KVCacheLayer(k_cache, v_cache, k_scale, v_scale)
    decodes = [i for i in range(len(lens)) if cu[i + 1] - cu[i] == 1]
    if len(decodes) == len(lens):  # a decode-only step: no row selection needed
        plan = _decode_plan(meta, None, block_size, sliding_window)
        out.copy_(_decode_attention(q, cache, plan, scale, softcap))
        return out
    if decodes:
        rows = torch.tensor([cu[i] for i in decodes], device=q.device)
        plan = _decode_plan(meta, decodes, block_size, sliding_window)
        out[rows] = _decode_attention(q[rows], cache, plan, scale, softcap).to(out.dtype)
    batched = set(decodes)
    for i, seq_len in enumerate(lens):
        start, end = cu[i], cu[i + 1]
        if end == start or i in batched:
            continue
        # Blocks before the first query's window are never read: a hybrid KV cache has freed them.
        first_block = 0 if sliding_window is None else max(0, seq_len - (end - start) - sliding_window + 1) // block_size
        k, v = _gather_context(cache, meta.block_table[i], seq_len, block_size, first_block)
        out[start:end] = _attend(
            q[start:end], k, v, seq_len, scale, sliding_window, softcap, first_block * block_size
        ).to(out.dtype)
    return out


def _decode_plan(
    meta: AttentionMetadata, decodes: list[int] | None, block_size: int, sliding_window: int | None
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Pool rows to gather for the single-query sequences `decodes` (None: all of them), each from
    its window start, the key mask, and a place for that mask as an additive one per dtype.

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
    meta.derived[key] = ids, mask, {}
    return meta.derived[key]


def _decode_attention(
    q: torch.Tensor,
    cache: KVCacheLayer,
    plan: tuple[torch.Tensor, torch.Tensor, dict],
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """All single-query sequences in one batched attention: one gather of their (windowed) blocks
    and one masked SDPA, instead of a gather and a kernel call per sequence. `plan`: `_decode_plan`.

    A quantized cache is dequantized by its per-key scales applied to the score columns (K) and
    the probability columns (V): the same products as scaling every element, G x L multiplies per
    KV head instead of L x D."""
    kv_heads, head_dim = cache.k.shape[2], cache.k.shape[3]
    ids, mask, biases = plan
    num_seqs, heads = q.shape[0], q.shape[1]
    groups = heads // kv_heads
    if cache.k_scale is None and softcap is None:
        # Torch's fused CPU attention, with each KV head's query heads as its query rows (no
        # GQA expansion) and one additive mask: faster than the fp32 matmuls below at every batch
        # size measured, and in the compute dtype like the prefill path's SDPA.
        k = _gather_blocks(cache.k, ids).view(num_seqs, -1, kv_heads, head_dim).transpose(1, 2).to(q.dtype)
        v = _gather_blocks(cache.v, ids).view(num_seqs, -1, kv_heads, head_dim).transpose(1, 2).to(q.dtype)
        if q.dtype not in biases:
            biases[q.dtype] = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        bias = biases[q.dtype]
        qh = q.reshape(num_seqs, kv_heads, groups, head_dim)
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=bias[:, None, None, :], scale=scale)
        return out.reshape(num_seqs, heads, head_dim)
    k = _as_fp32_heads(_gather_blocks(cache.k, ids).view(num_seqs, -1, kv_heads, head_dim))  # [S, KVH, L, D]
    v = _as_fp32_heads(_gather_blocks(cache.v, ids).view(num_seqs, -1, kv_heads, head_dim))
    # A quantized cache or a softcap: plain batched matmuls in fp32, the scales and the cap
    # applied to the score and probability columns.
    qh = q.float().reshape(num_seqs, kv_heads, groups, head_dim)
    scores = torch.matmul(qh, k.transpose(2, 3))  # [S, KVH, G, L]
    if cache.k_scale is not None:
        scores = scores * _gather_scales(cache.k_scale, ids, num_seqs)
    scores = scores * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    # Masked slots get weight 0; the pool holds finite values there (zero-initialised), as every
    # kernel reading whole blocks requires.
    probs = torch.softmax(scores, -1)
    if cache.v_scale is not None:
        probs = probs * _gather_scales(cache.v_scale, ids, num_seqs)
    out = torch.matmul(probs, v)  # [S, KVH, G, D]
    return out.reshape(num_seqs, heads, head_dim).to(q.dtype)


def _as_fp32_heads(rows: torch.Tensor) -> torch.Tensor:
    """`[S, L, KVH, D]` -> fp32 `[S, KVH, L, D]`. With several KV heads the layout is made
    contiguous in the same copy as the conversion: the batched matmul would otherwise copy the
    strided operand again, which took most of the decode attention. One KV head is contiguous
    already."""
    heads = rows.transpose(1, 2)
    if rows.shape[2] == 1:
        return heads.float()
    return heads.to(torch.float32, memory_format=torch.contiguous_format)


def _gather_blocks(pool: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    # index_select over 2-D block rows: far faster than advanced indexing of the 4-D pool on CPU.
    return pool.view(pool.shape[0], -1).index_select(0, ids)


def _gather_scales(scales: torch.Tensor, ids: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Scales of the gathered blocks as `[S, KVH, 1, L]`, to multiply score or probability columns."""
    rows = _gather_blocks(scales, ids).view(num_seqs, -1, scales.shape[2])  # [S, L, KVH]
    return rows.transpose(1, 2).unsqueeze(2)


def _gather_context(
    cache: KVCacheLayer, blocks: torch.Tensor, seq_len: int, block_size: int, first_block: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's keys and values from block `first_block` on, `[seq_len - first_block *
    block_size, KVH, D]`: as stored, or dequantized to fp32."""
    num_blocks = -(-seq_len // block_size)
    ids = blocks[first_block:num_blocks].long()
    length = seq_len - first_block * block_size

    def rows(pool: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        data = _gather_blocks(pool, ids).view(-1, pool.shape[2], pool.shape[3])[:length]
        if scales is None:
            return data
        return dequantize_kv_ref(data, _gather_blocks(scales, ids).view(-1, pool.shape[2])[:length])

    return rows(cache.k, cache.k_scale), rows(cache.v, cache.v_scale)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_len: int,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    key_start: int = 0,
) -> torch.Tensor:
    """q `[n, H, D]` are the last n positions of a context of `seq_len`; k/v `[seq_len - key_start,
    KVH, D]` its keys and values from position `key_start` on."""
    n = q.shape[0]
    dtype = q.dtype
    q_pos = torch.arange(seq_len - n, seq_len, device=q.device).unsqueeze(1)
    k_pos = torch.arange(key_start, seq_len, device=q.device).unsqueeze(0)
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
