"""Torch reference of the C attention's bf16 arithmetic (`cpu_attention_bf16.h`, CPUs with
AVX512_BF16): what `unified_attention_ref` computes, with the kernel's rounding points.

Each (query row, head) is computed alone, over its visible keys from the first, in partitions of
`KEY_PARTITION` keys merged at the end, each in chunks of `KEY_CHUNK` keys with an online softmax:
- scores: q and k rounded to bf16 (nearest even), their dot product summed in fp32 (the products
  are exact), times `scale` (an int8 cache: the dot product times the key's scale, then `scale`),
  softcapped;
- the running max and the weights' sum in fp32, the output rescaled when the max moves;
- values: each weight exp(s - running max) (an int8 cache: times the value's scale) and each value
  rounded to bf16, their products summed in fp32.
It leaves out only what tolerances cover: the kernel's exp polynomial, its summation orders, and
the flushing of denormals that vdpbf16ps does.
"""

from __future__ import annotations

import torch

from app.kernels.metadata import AttentionMetadata

KEY_CHUNK = 32  # cpu_attention.c's chunk and partition sizes
KEY_PARTITION = 512


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16 (nearest even), back in fp32."""
    return x.to(torch.bfloat16).float()


def unified_attention_bf16_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, meta: AttentionMetadata,
    scale: float, sliding_window: int | None = None, softcap: float | None = None,
    *, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`unified_attention_ref`'s inputs and layouts; writes and returns `out` (fp32 queries)."""
    block_size = k_cache.shape[1]
    cu, lens = meta.cu_seqlens_q.tolist(), meta.seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        pos = torch.arange(seq_len)
        slots = meta.block_table[i].long()[pos // block_size] * block_size + pos % block_size
        k, v = (c.view(-1, *c.shape[2:])[slots].float() for c in (k_cache, v_cache))  # int8: the codes
        ks, vs = (None, None) if k_scale is None else (s.view(-1, s.shape[2])[slots] for s in (k_scale, v_scale))
        n = cu[i + 1] - cu[i]
        lasts = torch.arange(seq_len - n, seq_len)
        firsts = lasts * 0 if sliding_window is None else (lasts - sliding_window + 1).clamp(min=0)
        for first in firsts.unique().tolist():  # rows from one first key: their chunks line up
            rows = (firsts == first).nonzero()[:, 0]
            out[cu[i] + rows] = _rows(q[cu[i] + rows].float(), k, v, ks, vs, first, lasts[rows], scale, softcap)
    return out


def _rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ks, vs, first: int, lasts: torch.Tensor, scale: float,
          softcap: float | None) -> torch.Tensor:
    """Rows `[R, H, D]` over keys first..lasts[r]: each row's partitions merged by their maxima."""
    heads, kv_heads = q.shape[1], k.shape[1]
    kv_of = torch.arange(heads) // (heads // kv_heads)
    y, mx, total = (torch.zeros_like(q), torch.full(q.shape[:2], float("-inf")), torch.zeros(q.shape[:2]))
    parts = []
    for p0 in range(first, int(lasts.max()) + 1, KEY_PARTITION):
        rows = (lasts >= p0).nonzero()[:, 0]
        part = _partition(q[rows], k, v, ks, vs, kv_of, p0, lasts[rows].clamp(max=p0 + KEY_PARTITION - 1), scale,
                          softcap)
        parts.append((rows, *part))
        mx[rows] = torch.maximum(mx[rows], part[1])
    if len(parts) == 1:  # one partition: the kernel's single piece
        return parts[0][1] / parts[0][3][..., None]
    for rows, py, pm, pl in parts:
        w = torch.exp(pm - mx[rows])
        total[rows] += w * pl
        y[rows] += w[..., None] * py
    return y / total[..., None]


def _partition(q, k, v, ks, vs, kv_of, first: int, lasts: torch.Tensor, scale: float, softcap: float | None):
    """Rows `[R, H, D]` over keys first..lasts[r] in chunks of KEY_CHUNK: the unnormalized outputs,
    the maxima and the weights' sums `[R, H]`."""
    qb = bf16_round(q).double()
    y = torch.zeros_like(q)
    m = torch.full(q.shape[:2], float("-inf"))
    total = torch.zeros(q.shape[:2])
    for c0 in range(first, int(lasts.max()) + 1, KEY_CHUNK):
        c1 = min(c0 + KEY_CHUNK, int(lasts.max()) + 1)
        kc = bf16_round(k[c0:c1, kv_of]).double()  # [n, H, D]
        s = torch.einsum("rhd,nhd->rhn", qb, kc).float()
        if ks is not None:
            s = s * ks[c0:c1, kv_of].T
        s = s * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill((torch.arange(c0, c1) > lasts[:, None])[:, None, :], float("-inf"))
        new_m = torch.maximum(m, s.amax(2))
        alpha = torch.exp(m - new_m)
        p = torch.exp(s - new_m[..., None])
        total = total * alpha + p.sum(2)
        y = y * alpha[..., None]
        if vs is not None:
            p = p * vs[c0:c1, kv_of].T
        y = y + torch.einsum("rhn,nhd->rhd", bf16_round(p).double(), bf16_round(v[c0:c1, kv_of]).double()).float()
        m = new_m
    return y, m, total
