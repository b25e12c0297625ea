"""Triton paged attention for one step that mixes prefill chunks and decodes (the CUDA path).

Design (after vLLM's unified attention): one program per (query tile of one sequence, KV head). A
tile packs BLOCK_Q consecutive query tokens times the QPK query heads that share the KV head into
BLOCK_M rows, so each K/V tile loaded from the paged cache serves the whole GQA group and `tl.dot`
keeps M >= 16 even for a single decode token. Keys are gathered per key through the block table,
so any cache block size works and a tile may span several blocks. Tiles that lie entirely before
the sliding window or after the causal limit are never visited.

Split-KV (flash-decoding): with few (sequence, KV head) pairs and long contexts the grid gets a third
axis that cuts each tile's key range into NUM_SPLITS pieces; each piece writes an unnormalised
partial (running max, running sum, accumulator) and `_reduce_splits_kernel` merges them.

An int8/fp8 cache (`kv_cache_dtype`) is dequantized in registers: the loaded tile converts exactly
to the compute dtype, and the per-key fp32 scales multiply the score columns (K) and the
probability columns (V) -- the product of scaling every element, BLOCK_M x BLOCK_N multiplies
instead of HEAD_DIM x BLOCK_N.

Semantics match `app.kernels.reference.unified_attention_ref` (see its docstring).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from app.kernels.metadata import AttentionMetadata

# Two pipeline stages of K and V tiles must fit beside the Q tile in the ~100 KB of shared memory
# that consumer GPUs (sm_86/sm_89) give one block.
_KV_STAGE_BYTES = 16 * 1024
_MAX_SPLITS = 16
# A split should still stream a few KV tiles, or the reduce costs more than the split saves.
_MIN_TILES_PER_SPLIT = 4


@triton.jit
def _find_seq_idx(cu_seqlens_q_ptr, tile_idx, num_seqs, BLOCK_Q: tl.constexpr):
    # Sequence i's tiles start at cu[i] // BLOCK_Q + i: the "+ i" reserves one spare tile per
    # sequence so a tile never straddles two sequences; find the last start <= tile_idx.
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if start <= tile_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tanh(x):
    # exp-based so it runs in the interpreter too; saturates cleanly at +-1 for large |x|.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    # fp32 inputs get full-precision dots (not TF32) so they match the fp32 reference; fp16/bf16
    # use the backend default.
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _unified_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    block_table_ptr,
    scale,
    softcap,
    sliding_window,
    num_seqs,
    num_heads,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ksb,
    stride_kss,
    stride_ksh,
    stride_vsb,
    stride_vss,
    stride_vsh,
    stride_bt,
    QPK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    tile_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq_idx(cu_seqlens_q_ptr, tile_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    local_tile = tile_idx - (q_start // BLOCK_Q + seq)
    if local_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # the step's queries are the last q_len positions

    # Row r of the tile is query token r // QPK of the tile and head r % QPK of the KV group.
    rows = tl.arange(0, BLOCK_M)
    q_idx = local_tile * BLOCK_Q + rows // QPK
    head = kv_head * QPK + rows % QPK
    row_ok = (rows < BLOCK_Q * QPK) & (q_idx < q_len)
    q_pos = context_len + q_idx
    token = (q_start + q_idx).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM

    q_offs = token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # Keys any row of this tile may see: [key_lo, key_hi).
    first_pos = context_len + local_tile * BLOCK_Q
    key_hi = context_len + tl.minimum(local_tile * BLOCK_Q + BLOCK_Q, q_len)
    key_lo = 0
    if USE_WINDOW:
        key_lo = tl.maximum(first_pos - sliding_window + 1, 0)
    tile_lo = key_lo // BLOCK_N
    tile_hi = tl.cdiv(key_hi, BLOCK_N)
    tiles_per_split = tl.cdiv(tile_hi - tile_lo, NUM_SPLITS)
    tile_begin = tile_lo + split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, tile_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634  # log2(e): the softmax runs in base 2 (exp2)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt

    for tile in range(tile_begin, tile_end):
        keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        # Keys before key_lo are invisible to every row of the tile: their block-table entries are
        # not even read (a hybrid KV cache may have freed those blocks).
        key_ok = (keys >= key_lo) & (keys < key_hi)
        blocks = tl.load(bt_row + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        in_block = keys % BLOCK_SIZE
        # K is loaded transposed, [HEAD_DIM_PAD, BLOCK_N], ready for q @ k.
        k_offs = blocks[None, :] * stride_kb + in_block[None, :] * stride_ks + dims[:, None] * stride_kd
        k_offs += kv_head * stride_kh
        k = tl.load(k_cache_ptr + k_offs, mask=dim_ok[:, None] & key_ok[None, :], other=0.0)
        v_offs = blocks[:, None] * stride_vb + in_block[:, None] * stride_vs + dims[None, :] * stride_vd
        v_offs += kv_head * stride_vh
        v = tl.load(v_cache_ptr + v_offs, mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        # The reference casts the cache to the query dtype before attending. int8/fp8 values are
        # exact in it, so the interpreter may go straight to fp32 (its int8 -> bf16 cast is broken).
        if not (UPCAST and KV_QUANT):
            k = k.to(q_ptr.dtype.element_ty)
            v = v.to(q_ptr.dtype.element_ty)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = _dot(q, k, IEEE_DOT)
        if KV_QUANT:
            k_scale = tl.load(
                k_scale_ptr + blocks * stride_ksb + in_block * stride_kss + kv_head * stride_ksh, mask=key_ok, other=0.0
            )
            s = s * k_scale[None, :]
        if USE_SOFTCAP:
            s = softcap * _tanh(s * (scale / softcap)) * 1.4426950408889634
        else:
            s = s * qk_scale
        visible = row_ok[:, None] & (keys[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (keys[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible yet keeps max -inf; shift by 0 there so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_QUANT:  # the softmax sums p; the values are p * v_scale
            v_scale = tl.load(
                v_scale_ptr + blocks * stride_vsb + in_block * stride_vss + kv_head * stride_vsh, mask=key_ok, other=0.0
            )
            p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE_DOT)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_offs = token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    else:
        part_row = (token * num_heads + head) * NUM_SPLITS + split
        tl.store(part_max_ptr + part_row, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part_row, l_i, mask=row_ok)
        acc_offs = part_row[:, None] * HEAD_DIM_PAD + dims[None, :]
        tl.store(part_acc_ptr + acc_offs, acc, mask=row_ok[:, None])


@triton.jit
def _reduce_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    cu_seqlens_q_ptr,
    num_seqs,
    num_heads,
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    # Rows outside every sequence (batch padding) have no partials; leave out untouched there.
    if (token < tl.load(cu_seqlens_q_ptr)) | (token >= tl.load(cu_seqlens_q_ptr + num_seqs)):
        return
    part_row = (token.to(tl.int64) * num_heads + head) * NUM_SPLITS
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM_PAD)
    m = tl.load(part_max_ptr + part_row + splits)
    l = tl.load(part_sum_ptr + part_row + splits)
    acc = tl.load(part_acc_ptr + (part_row + splits[:, None]) * HEAD_DIM_PAD + dims[None, :])
    m_all = tl.max(m, 0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    weight = tl.exp2(m - m_all)  # empty splits carry max -inf: weight 0
    total = tl.sum(l * weight, 0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    o_offs = token.to(tl.int64) * stride_ot + head * stride_oh + dims * stride_od
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _is_interpreted(kernel: object) -> bool:
    # Under TRITON_INTERPRET=1 `triton.jit` returns an interpreter object instead of a JITFunction.
    return not isinstance(kernel, triton.runtime.JITFunction)


def _default_tiles(
    q: torch.Tensor, k_cache: torch.Tensor, qpk: int, head_dim_pad: int, decode_only: bool
) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps). Checked by compiling for sm_80/sm_89/sm_90: no register
    spills, shared memory under the ~100 KB a consumer GPU gives one block."""
    group = triton.next_power_of_2(qpk)
    if q.dtype == torch.float32:
        # fp32 dots run on FMA units with operands in registers: small tiles or heavy spills.
        return max(16, group), 16, 4
    block_m = max(16 if decode_only else 64, group)
    block_n = 64
    elem_bytes = max(k_cache.element_size(), q.element_size())
    while block_n > 16 and block_n * head_dim_pad * elem_bytes > _KV_STAGE_BYTES:
        block_n //= 2
    return block_m, block_n, 8 if block_m * head_dim_pad >= 64 * 128 else 4


def _default_num_splits(q: torch.Tensor, num_seqs: int, num_kv_heads: int, max_keys: int, block_n: int) -> int:
    """Flash-decoding only pays when a decode-only step leaves most SMs idle and contexts are long."""
    if q.shape[0] > num_seqs or q.device.type != "cuda":
        return 1
    programs = num_seqs * num_kv_heads
    sms = _sm_count(q.device.index if q.device.index is not None else torch.cuda.current_device())
    if programs >= sms:
        return 1
    splits = 1
    max_tiles = triton.cdiv(max_keys, block_n)
    while splits < _MAX_SPLITS and programs * splits < 2 * sms and max_tiles >= 2 * splits * _MIN_TILES_PER_SPLIT:
        splits *= 2
    return splits


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel launch: grid, runtime arguments in the kernel's order, constexprs, options.

    Planning apart from launching lets tests compile the exact launches for a GPU target
    without a GPU (tests/kernels/test_kernels.py)."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple
    constexprs: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 2

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.constexprs, num_warps=self.num_warps, num_stages=self.num_stages)


def plan_unified_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, meta: AttentionMetadata,
    scale: float, sliding_window: int | None = None, softcap: float | None = None,
    *, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    num_splits: int | None = None, block_m: int | None = None, block_n: int | None = None,
) -> list[KernelLaunch]:
    """The launches `triton_unified_attention` makes (none for an empty batch); allocates the split-KV
    partials. Reads only shapes, dtypes and strides, so it works on tensors of device "meta"."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = meta.num_seqs
    if num_tokens == 0 or num_seqs == 0:
        return []
    qpk = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
    default_m, default_n, num_warps = _default_tiles(q, k_cache, qpk, head_dim_pad, num_tokens <= num_seqs)
    block_m = block_m or default_m
    block_n = block_n or default_n
    if num_splits is None:
        num_splits = _default_num_splits(q, num_seqs, num_kv_heads, meta.block_table.shape[1] * block_size, block_n)
    if block_m < qpk or block_m & (block_m - 1) or num_splits & (num_splits - 1) or block_n & (block_n - 1):
        raise ValueError(f"block_m ({block_m}, >= {qpk}), block_n ({block_n}) and num_splits must be powers of 2")
    block_q = block_m // qpk
    # Upper bound on the tiles of all sequences: sum(ceil(n_i / BLOCK_Q)) <= num_tokens // BLOCK_Q + num_seqs.
    num_tiles = num_tokens // block_q + num_seqs

    if num_splits > 1:
        part_acc = torch.empty(num_tokens, num_heads, num_splits, head_dim_pad, dtype=torch.float32, device=q.device)
        part_max = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused by the kernel when NUM_SPLITS == 1
    kv_quant = k_scale is not None
    if kv_quant:
        scales = (k_scale, v_scale, *k_scale.stride(), *v_scale.stride())
    else:  # never read: KV_QUANT == False compiles the scale loads out
        scales = (k_cache, v_cache, 0, 0, 0, 0, 0, 0)

    attention = KernelLaunch(
        _unified_attention_kernel,
        (num_tiles, num_kv_heads, num_splits),
        (
            q,
            k_cache,
            v_cache,
            scales[0],
            scales[1],
            out,
            part_acc,
            part_max,
            part_sum,
            meta.cu_seqlens_q,
            meta.seq_lens,
            meta.block_table,
            float(scale),
            float(softcap or 0.0),
            int(sliding_window or 0),
            num_seqs,
            num_heads,
            *q.stride(),
            *out.stride(),
            *k_cache.stride(),
            *v_cache.stride(),
            *scales[2:],
            meta.block_table.stride(0),
        ),
        {
            "QPK": qpk,
            "HEAD_DIM": head_dim,
            "HEAD_DIM_PAD": head_dim_pad,
            "BLOCK_SIZE": block_size,
            "BLOCK_M": block_m,
            "BLOCK_Q": block_q,
            "BLOCK_N": block_n,
            "USE_WINDOW": sliding_window is not None,
            "USE_SOFTCAP": softcap is not None,
            "NUM_SPLITS": num_splits,
            # The interpreter computes bf16 dots wrongly; fp32 there is exact enough to test the logic.
            "UPCAST": _is_interpreted(_unified_attention_kernel),
            "IEEE_DOT": q.dtype == torch.float32,
            "KV_QUANT": kv_quant,
        },
        num_warps=num_warps,
    )
    if num_splits == 1:
        return [attention]
    reduce = KernelLaunch(
        _reduce_splits_kernel,
        (num_tokens, num_heads),
        (out, part_acc, part_max, part_sum, meta.cu_seqlens_q, num_seqs, num_heads, *out.stride()),
        {"HEAD_DIM": head_dim, "HEAD_DIM_PAD": head_dim_pad, "NUM_SPLITS": num_splits},
    )
    return [attention, reduce]


def triton_unified_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, meta: AttentionMetadata,
    scale: float, sliding_window: int | None = None, softcap: float | None = None,
    *, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    num_splits: int | None = None, block_m: int | None = None, block_n: int | None = None,
) -> torch.Tensor:
    """Run the Triton kernel(s); same contract as `unified_attention_ref`: writes and returns `out`.

    `num_splits` (a power of 2; > 1 selects split-KV + reduce), `block_m` and `block_n` (powers of 2,
    >= 16) override the launch heuristics; tests use them to reach every code path with tiny shapes.
    """
    plan = plan_unified_attention(
        q, k_cache, v_cache, out, meta, scale, sliding_window, softcap, k_scale=k_scale, v_scale=v_scale,
        num_splits=num_splits, block_m=block_m, block_n=block_n,
    )
    for launch in plan:
        launch()
    return out
