"""kv_cache_dtype int8 on the CPU path: the torch reference stores each (token, KV head) row as int8
with its own fp32 scale and attends the dequantized values. Its results stay close to attention
over an fp32 cache, and it keeps the unquantized path's contract (padding slots, windows, packed
prefill + decode). The Triton kernels are checked against these references in test_kernels.py."""

from __future__ import annotations

import pytest
import torch

from app import kernels
from app.kernels.kv_quant import dequantize_kv_ref, quantize_kv_ref

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 32, 8


def test_quantize_round_trip_is_within_half_a_step() -> None:
    x = torch.randn(50, KV_HEADS, HEAD_DIM) * torch.logspace(-3, 2, 50)[:, None, None]
    x[3, 1] = 0.0  # an all-zero row: scale 0, zeros stored, no NaN
    data, scale = quantize_kv_ref(x, torch.int8)
    assert data.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (50, KV_HEADS)
    assert scale[3, 1] == 0 and not data[3, 1].any()
    assert data.abs().amax(-1).eq(127).sum() == 50 * KV_HEADS - 1  # symmetric: each row's absmax is +-127
    err = (dequantize_kv_ref(data, scale) - x).abs()
    assert (err <= scale.unsqueeze(-1) * 0.5 + 1e-6 * x.abs()).all()


def _pool(num_blocks: int) -> dict[str, torch.Tensor]:
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    return {
        "fp32": (torch.zeros(shape), torch.zeros(shape)),
        "int8": (torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8)),
        "scales": {"k_scale": torch.zeros(shape[:3]), "v_scale": torch.zeros(shape[:3])},
    }


def _store_prompts(pool: dict, seq_lens: list[int], gen: torch.Generator) -> torch.Tensor:
    """Store random K/V for every position of every sequence (block i of sequence s: s * 8 + i,
    reversed, so tables are not the identity) into both pools; return the block table."""
    table = torch.stack([torch.arange(8).flip(0) + 8 * s for s in range(len(seq_lens))]).to(torch.int32)
    for s, n in enumerate(seq_lens):
        k, v = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen), torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen)
        pos = torch.arange(n)
        slots = table[s, pos // BLOCK].long() * BLOCK + pos % BLOCK
        kernels.store_kv(k, v, *pool["fp32"], slots)
        kernels.store_kv(k, v, *pool["int8"], slots, **pool["scales"])
    return table


@pytest.mark.parametrize(
    ("q_lens", "window"),
    [
        ((1, 1, 1), None),  # decode-only
        ((5, 1, 19, 1, 0), None),  # prefill chunk after a prefix, decodes, a first chunk, an idle sequence
        ((5, 1, 19, 1, 0), 6),  # the same under a sliding window
    ],
)
def test_int8_cache_attends_like_fp32(q_lens: tuple[int, ...], window: int | None) -> None:
    gen = torch.Generator().manual_seed(0)
    seq_lens = [37, 9, 19, 60, 12][: len(q_lens)]
    pool = _pool(8 * len(seq_lens))
    table = _store_prompts(pool, seq_lens, gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = kernels.AttentionMetadata(cu, torch.tensor(seq_lens, dtype=torch.int32), table)
    q = torch.randn(sum(q_lens), HEADS, HEAD_DIM, generator=gen)
    ref, out = torch.zeros_like(q), torch.zeros_like(q)
    kernels.unified_attention(q, *pool["fp32"], ref, meta, HEAD_DIM**-0.5, window)
    kernels.unified_attention(q, *pool["int8"], out, meta, HEAD_DIM**-0.5, window, **pool["scales"])
    assert ((out - ref).norm() / ref.norm()).item() < 0.015


def test_int8_store_skips_padding_slots_and_is_per_row() -> None:
    pool = _pool(2)
    k_cache, v_cache = pool["int8"]
    k_scale, v_scale = pool["scales"].values()
    k_cache.fill_(5)
    k_scale.fill_(9.0)
    k = torch.randn(3, KV_HEADS, HEAD_DIM)
    k[2] *= 1000  # a huge row does not change its neighbours' scales
    kernels.store_kv(k, k.clone(), k_cache, v_cache, torch.tensor([3, -1, 12]), k_scale=k_scale, v_scale=v_scale)
    flat_k, flat_s = k_cache.view(-1, KV_HEADS, HEAD_DIM), k_scale.view(-1, KV_HEADS)
    untouched = [s for s in range(2 * BLOCK) if s not in (3, 12)]
    assert (flat_k[untouched] == 5).all() and (flat_s[untouched] == 9.0).all()
    torch.testing.assert_close(flat_s[3], k[0].abs().amax(-1) / 127)
    torch.testing.assert_close(flat_s[12], k[2].abs().amax(-1) / 127)
    assert torch.equal(v_scale.view(-1, KV_HEADS)[[3, 12]], flat_s[[3, 12]])


def test_bf16_compute_over_int8_cache() -> None:
    """The serving case on a bf16 CPU: queries bf16, cache int8; the prefill path dequantizes then
    casts to bf16, the decode path computes in fp32."""
    gen = torch.Generator().manual_seed(1)
    pool = _pool(16)
    table = _store_prompts(pool, [30, 11], gen)
    meta = kernels.AttentionMetadata(
        torch.tensor([0, 6, 7], dtype=torch.int32), torch.tensor([30, 11], dtype=torch.int32), table
    )
    q = torch.randn(7, HEADS, HEAD_DIM, generator=gen)
    ref, out = torch.zeros_like(q), torch.zeros(7, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    kernels.unified_attention(q, *pool["fp32"], ref, meta, 0.2)
    kernels.unified_attention(q.bfloat16(), *pool["int8"], out, meta, 0.2, **pool["scales"])
    assert ((out.float() - ref).norm() / ref.norm()).item() < 0.02


@pytest.mark.parametrize(
    ("cache_dtype", "scales", "error"),
    [
        (torch.int8, None, "needs k_scale"),
        (torch.float32, torch.zeros(2, BLOCK, KV_HEADS), "takes no scales"),
        (torch.int8, torch.zeros(2, BLOCK, KV_HEADS, dtype=torch.float16), "needs k_scale"),
        (torch.int8, torch.zeros(2, BLOCK, 1), "needs k_scale"),
    ],
)
def test_cache_and_scales_must_agree(cache_dtype, scales, error) -> None:
    cache = torch.zeros(2, BLOCK, KV_HEADS, HEAD_DIM, dtype=cache_dtype)
    k = torch.zeros(1, KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match=error):
        kernels.store_kv(k, k, cache, cache, torch.zeros(1, dtype=torch.int64), k_scale=scales, v_scale=scales)
    with pytest.raises(ValueError, match=error):
        kernels.KVCacheLayer(cache, cache, scales, scales)
