"""Vectorized torch dequantization of GGUF tensor bytes, bit-exact with `gguf.quants.dequantize`.

Each block type is decoded on a `[n_blocks, type_size]` uint8 view with bit ops and one fp32
multiply (and one add or subtract for the types with mins; IQ4's grid values are looked up first),
in the same order as the reference, so the results are identical. Large tensors are processed in
chunks of blocks so that the temporaries (unpacked nibbles, torch's dtype-promotion copies) stay
small and cache-resident.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields, replace
from types import MappingProxyType

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import IQ4_NL

from app.engine.types.errors import GGUFError

_T = GGMLQuantizationType

# The non-linear 4-bit grid IQ4_NL and IQ4_XS index into, as fp32 (exact: all small integers).
_IQ4_GRID = torch.tensor(IQ4_NL.kvalues, dtype=torch.float32)

# Output elements per chunk: large enough to amortize per-op dispatch (~25 small torch ops per
# chunk), small enough for the uint8/int32 temporaries to stay in cache.
_CHUNK_ELEMENTS = 1 << 20


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 field at byte `start` of every block, as fp32 of shape [n, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _words(packed: torch.Tensor) -> torch.Tensor:
    """`packed` (last dim a multiple of 4) as int32 words.

    .contiguous() returns a one-block slice as it is, and its start or row stride need not be
    4-byte aligned (a single-block tensor, or the last chunk of a tensor): those get copied.
    """
    packed = packed.contiguous()
    if packed.storage_offset() % 4 or any(s % 4 for s in packed.stride()[:-1]):
        packed = packed.clone(memory_format=torch.contiguous_format)
    return packed.view(torch.int32)


def _nibble_planes(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Low and high nibbles of every byte, as two new contiguous uint8 tensors shaped like `packed`
    (whose last dim must be a multiple of 4).

    The masking runs on int32 words, four bytes per element: torch's uint8 bit ops are several
    times slower per byte. Kernels write the two planes into the two halves of the output
    separately, since interleaving them first (stack/cat) costs more than the unpacking.
    """
    words = _words(packed)
    return (words & 0x0F0F0F0F).view(torch.uint8), ((words >> 4) & 0x0F0F0F0F).view(torch.uint8)


def _bits(packed: torch.Tensor, width: int, lshift: int) -> torch.Tensor:
    """[n, k] bytes (k % 4 == 0) -> [n, 8 // width, k]: plane j holds field j (bits j*width ..) of
    each byte, shifted left by `lshift` (which must keep it inside its byte).

    Works on int32 words: torch's uint8 shifts by a tensor are not vectorized, int32 ones are,
    and the per-byte mask keeps bits from crossing into the neighbouring byte.
    """
    words = _words(packed).unsqueeze(1)
    shifts = torch.arange(0, 8, width, dtype=torch.int32).view(-1, 1)
    byte_mask = ((1 << width) - 1) * 0x01010101
    return (((words >> shifts) & byte_mask) << lshift).view(torch.uint8)


def _scaled_halves(d: torch.Tensor, planes: Iterable[torch.Tensor], out: torch.Tensor) -> None:
    """out = d * q, where `planes` are the values of the first and the second half of each group of
    `out` (groups of 2 * q.shape[-1] elements; `d` broadcasts against one plane)."""
    for half, q in enumerate(planes):
        torch.mul(q, d, out=out.view(*q.shape[:-1], 2, q.shape[-1]).select(-2, half))


def _q8_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    torch.mul(blocks[:, 2:].view(torch.int8), _f16(blocks, 0), out=out)


def _q4_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _scaled_halves(_f16(blocks, 0), (q.view(torch.int8).sub_(8) for q in _nibble_planes(blocks[:, 2:])), out)


def _q5_planes(blocks: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q5_0/Q5_1 quants (uint8, 0..31) of the two 16-element halves, from the uint32 of 5th bits at
    byte `start` and the 16 bytes of nibbles after it."""
    # Bit i of the little-endian uint32 is the 5th bit of element i. Shifting in int32 and then
    # truncating to uint8 is faster than unpacking the four bytes separately.
    qh = _words(blocks[:, start:start + 4])
    high = (qh >> torch.arange(32, dtype=torch.int32)).to(torch.uint8).bitwise_and_(1).mul_(16).view(-1, 2, 16)
    low, top = _nibble_planes(blocks[:, start + 4:])
    return low.bitwise_or_(high[:, 0]), top.bitwise_or_(high[:, 1])


def _q5_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _scaled_halves(_f16(blocks, 0), (q.view(torch.int8).sub_(16) for q in _q5_planes(blocks, 2)), out)


def _with_min(blocks: torch.Tensor, planes: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor) -> None:
    """Q4_1/Q5_1: out = d * q + m, the product rounded to fp32 before the add as in the reference
    (a fused multiply-add would differ in the last bit)."""
    _scaled_halves(_f16(blocks, 0), planes, out)
    out.add_(_f16(blocks, 2))


def _q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _with_min(blocks, _nibble_planes(blocks[:, 4:]), out)


def _q5_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _with_min(blocks, _q5_planes(blocks, 4), out)


def _iq4_values(planes: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """IQ4 nibbles -> the non-linear grid's values. int64 indices: a uint8 index would be a mask."""
    return (_IQ4_GRID[q.long()] for q in planes)


def _iq4_nl(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _scaled_halves(_f16(blocks, 0), _iq4_values(_nibble_planes(blocks[:, 2:])), out)


def _iq4_xs(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # Sub-block s's 6-bit scale is nibble s % 2 of scales_l[s // 2] (bytes 4..7) with bits 2s..2s+1
    # of the uint16 scales_h (bytes 2..3) on top; each sub-block is 16 low then 16 high nibbles.
    low = torch.stack(_nibble_planes(blocks[:, 4:8]), dim=-1).view(-1, 8)
    top = (blocks[:, 2:4].contiguous().view(torch.int16).int() >> torch.arange(0, 16, 2, dtype=torch.int32)) & 3
    scales = low.bitwise_or_(top.to(torch.uint8) << 4).view(torch.int8).sub_(32)
    dl = (_f16(blocks, 0) * scales).unsqueeze(-1)
    _scaled_halves(dl, _iq4_values(_nibble_planes(blocks[:, 8:].reshape(-1, 8, 16))), out)


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K 12-byte field -> eight 6-bit scales and eight 6-bit mins per block."""
    lo, hi, mix = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], dim=1)
    mins = torch.cat([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], dim=1)
    return scales, mins


def _k_affine(blocks: torch.Tensor, planes: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor) -> None:
    """out = (d * scale) * q - (dmin * min) per 32-element sub-block, in the reference's op order.

    `planes` are the [n, 4, 32] quants of the even and the odd sub-blocks (low / high nibbles).
    """
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    d = (_f16(blocks, 0) * scales).view(-1, 4, 2, 1)
    dm = (_f16(blocks, 2) * mins).view(-1, 8, 1)
    halves = out.view(-1, 4, 2, 32)
    for half, q in enumerate(planes):
        torch.mul(q, d[:, :, half], out=halves[:, :, half])
    out.view(-1, 8, 32).sub_(dm)


def _q4_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _k_affine(blocks, _nibble_planes(blocks[:, 16:].view(-1, 4, 32)), out)


def _q5_k_planes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q5_K quants (0..31) of the even and the odd sub-blocks, [n, 4, 32] each."""
    low, high = _nibble_planes(blocks[:, 48:].view(-1, 4, 32))
    # Bit s of qh[l] is the 5th bit of element l of sub-block s (even s: low nibbles, odd: high).
    fifth = _bits(blocks[:, 16:48], 1, lshift=4).view(-1, 4, 2, 32)
    return low.bitwise_or_(fifth[:, :, 0]), high.bitwise_or_(fifth[:, :, 1])


def _q5_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _k_affine(blocks, _q5_k_planes(blocks), out)


def _q6_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # Byte h*128 + r of the quants (h in {0, 1}, r < 128) is nibble r // 64 of ql[h*64 + r % 64],
    # plus bits 2k..2k+1 (k = r // 32) of qh[h*32 + r % 32] on top; the scale changes every 16.
    low = torch.cat(_nibble_planes(blocks[:, 0:128].reshape(-1, 2, 64)), dim=-1)
    top = _bits(blocks[:, 128:192].reshape(-1, 32), 2, lshift=4).view(-1, 2, 128)
    q = low.bitwise_or_(top).view(torch.int8).sub_(32)
    _per_16(q, _f16(blocks, 208) * blocks[:, 192:208].view(torch.int8), out)


def _per_16(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = scale * q for the 16 groups of 16 of each 256-element block; `scales` is [n, 16] fp32."""
    return torch.mul(q.view(-1, 16, 16), scales.unsqueeze(-1), out=out.view(-1, 16, 16))


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K/Q3_K's 64 bytes of 2-bit quants -> [n, 256] uint8: element h*128 + j*32 + l is
    bits 2j..2j+1 of byte h*32 + l."""
    return _bits(qs.reshape(-1, 32), 2, lshift=0).view(-1, 256)


def _q2_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # Each group of 16 has a 4-bit scale (low nibble) and a 4-bit min (high nibble) in bytes 0..15.
    scales = blocks[:, 0:16]
    _per_16(_crumbs(blocks[:, 16:80]), _f16(blocks, 80) * (scales & 0x0F), out)
    out.view(-1, 16, 16).sub_((_f16(blocks, 82) * (scales >> 4)).unsqueeze(-1))


def _q3_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # Bit j of hmask[l] (bytes 0..31) is the 3rd bit of element j*32 + l; the quant is offset by -4
    # where it is clear, i.e. q = (low | bit << 2) - 4.
    q = _crumbs(blocks[:, 32:96]).bitwise_or_(_bits(blocks[:, 0:32], 1, lshift=2).view(-1, 256))
    # 6-bit scales: low nibbles of bytes 96..103, then their high nibbles; bits 2k..2k+1 of byte
    # 104 + s % 4 on top of scale s, k = s // 4.
    low = torch.cat(_nibble_planes(blocks[:, 96:104]), dim=1)
    scales = low.bitwise_or_(_bits(blocks[:, 104:108], 2, lshift=4).view(-1, 16)).view(torch.int8).sub_(32)
    _per_16(q.view(torch.int8).sub_(4), _f16(blocks, 108) * scales, out)


_BLOCK_KERNELS: MappingProxyType[int, Callable[[torch.Tensor, torch.Tensor], None]] = MappingProxyType({
    int(_T.Q8_0): _q8_0,
    int(_T.Q4_0): _q4_0,
    int(_T.Q4_1): _q4_1,
    int(_T.Q5_0): _q5_0,
    int(_T.Q5_1): _q5_1,
    int(_T.Q4_K): _q4_k,
    int(_T.Q5_K): _q5_k,
    int(_T.Q6_K): _q6_k,
    int(_T.Q2_K): _q2_k,
    int(_T.Q3_K): _q3_k,
    int(_T.IQ4_NL): _iq4_nl,
    int(_T.IQ4_XS): _iq4_xs,
})

_FLOAT_VIEWS: MappingProxyType[int, torch.dtype] = MappingProxyType({
    int(_T.F32): torch.float32,
    int(_T.F16): torch.float16,
    int(_T.BF16): torch.bfloat16,
})

SUPPORTED_TYPES: frozenset[int] = frozenset(_FLOAT_VIEWS) | frozenset(_BLOCK_KERNELS)


def type_name(ggml_type: int) -> str:
    """gguf's name for a ggml type id, or a placeholder for ids gguf does not know."""
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"<unknown type id {ggml_type}>"


def _where(name: str | None) -> str:
    return f"tensor {name!r}: " if name else "tensor "


def _as_uint8_tensor(raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(raw, torch.Tensor):
        t = raw
    else:
        arr = np.asarray(raw)
        if arr.dtype != np.uint8:
            raise TypeError(f"raw tensor bytes must be uint8, got numpy {arr.dtype}")
        t = _from_numpy(arr)
    if t.dtype != torch.uint8:
        raise TypeError(f"raw tensor bytes must be uint8, got {t.dtype}")
    return t.reshape(-1)


def _from_numpy(arr: np.ndarray) -> torch.Tensor:
    """Zero-copy tensor over `arr`, which may be a read-only view into the file mapping.

    DLPack (numpy >= 2.1) marks the export read-only and torch takes it silently; torch.from_numpy
    would warn on every read-only array. The tensor is only ever read.
    """
    if arr.flags.writeable:
        return torch.from_numpy(arr)
    try:
        return torch.from_dlpack(arr)
    except (BufferError, TypeError, RuntimeError):
        with warnings.catch_warnings():  # older numpy cannot export read-only arrays via DLPack
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.from_numpy(arr)


def _check_request(ggml_type: int, shape: tuple[int, ...], nbytes: int, name: str | None) -> None:
    if ggml_type not in SUPPORTED_TYPES:
        supported = ", ".join(type_name(t) for t in sorted(SUPPORTED_TYPES))
        raise GGUFError(f"{_where(name)}type {type_name(ggml_type)} is not supported (supported: {supported})")
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    if any(d < 0 for d in shape):
        raise GGUFError(f"{_where(name)}shape {tuple(shape)} has a negative dimension")
    row = shape[-1] if shape else 1
    if row % block_size:
        raise GGUFError(
            f"{_where(name)}shape {tuple(shape)} does not fit {type_name(ggml_type)} blocks of {block_size} elements"
        )
    expected = math.prod(shape) // block_size * type_size
    if nbytes != expected:
        raise GGUFError(
            f"{_where(name)}has {nbytes} bytes, but shape {tuple(shape)} of {type_name(ggml_type)} needs {expected}"
        )


def dequantize(
    raw: np.ndarray | torch.Tensor,
    ggml_type: int,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
    *,
    name: str | None = None,
) -> torch.Tensor:
    """Decode a tensor's GGUF bytes into a new (owned, writable) tensor of `shape` and `dtype`.

    `shape` is in torch order (the ggml dims reversed); `name` only improves error messages.
    Values are computed in fp32 exactly as `gguf.quants.dequantize` does, then cast to `dtype`.
    """
    if not dtype.is_floating_point:
        raise ValueError(f"dequantize needs a floating-point dtype, got {dtype}")
    shape = tuple(int(d) for d in shape)
    data = _as_uint8_tensor(raw)
    ggml_type = int(ggml_type)
    _check_request(ggml_type, shape, data.numel(), name)
    if data.numel() == 0:
        return torch.empty(shape, dtype=dtype)
    float_dtype = _FLOAT_VIEWS.get(ggml_type)
    if float_dtype is not None:
        # .to() always copies here, so the result never aliases the (read-only) file mapping.
        if data.storage_offset() % float_dtype.itemsize:
            data = data.clone()  # a torch dtype view needs an element-aligned start
        src = data.view(float_dtype)
        return (src.clone() if float_dtype == dtype else src.to(dtype)).view(shape)
    return _dequantize_blocks(data, ggml_type, dtype).view(shape)


def cat_rows(forms: list):
    """Forms of one dataclass stacked row-wise (fused q/k/v, gate/up): each tensor field concatenated,
    each int field (bits) the largest, since 4-bit levels are valid 5-bit ones."""
    if len(forms) == 1:
        return forms[0]
    first = forms[0]
    return type(first)(*(
        torch.cat([getattr(f, fl.name) for f in forms]) if isinstance(getattr(first, fl.name), torch.Tensor)
        else None if getattr(first, fl.name) is None else max(getattr(f, fl.name) for f in forms)
        for fl in fields(first)))


@dataclass(frozen=True)
class GridForm:
    """A tensor of 4- or 5-bit GGUF blocks as the C kernels' groups hold it: per group of 32
    consecutive weights of a row, w = level * step + low (level 0..15 or 0..31). Read straight
    from the blocks, so no fit against dequantized values is needed."""

    levels: torch.Tensor  # uint8 [rows, k]
    step: torch.Tensor  # fp32 [rows, k // 32]
    low: torch.Tensor  # fp32 [rows, k // 32]
    bits: int
    # Q4_K's own numbers, as `NibbleForm`'s; None for other types:
    d: torch.Tensor | None = None
    dmin: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None

    @staticmethod
    def cat(forms: list[GridForm | Q6Form | None]) -> GridForm | Q6Form | None:
        """Row-wise concatenation (fused q/k/v, gate/up); 4-bit levels are valid 5-bit ones. Forms
        of both kinds (a Q6_K v beside Q4_K q and k) have no common one: None. Q4_K's own numbers
        are kept only where every part has them."""
        if not forms or any(f is None for f in forms) or len({type(f) for f in forms}) != 1:
            return None
        if isinstance(forms[0], GridForm) and any(f.scales is None for f in forms):
            forms = [replace(f, d=None, dmin=None, scales=None, mins=None) for f in forms]
        return cat_rows(forms)


@dataclass(frozen=True)
class Q6Form:
    """A Q6_K tensor as the C kernels hold it at its own bits: w = d * scale * (level - 32), per
    16 weights an int8 scale, per 32 the block's fp16 d (repeated)."""

    levels: torch.Tensor  # uint8 [rows, k], 0..63
    scales: torch.Tensor  # int8 [rows, k // 16]
    d: torch.Tensor  # fp32 [rows, k // 32]
    bits: int = 6


def _q6_k_form(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q6_K blocks -> (levels [n, 256] uint8 as _q6_k orders them, scales [n, 16] int8, d [n, 8])."""
    low = torch.cat(_nibble_planes(blocks[:, 0:128].reshape(-1, 2, 64)), dim=-1)
    top = _bits(blocks[:, 128:192].reshape(-1, 32), 2, lshift=4).view(-1, 2, 128)
    levels = low.bitwise_or_(top).view(-1, 256)
    return levels, blocks[:, 192:208].contiguous().view(torch.int8), _f16(blocks, 208).expand(-1, 8)


def _grid_legacy(planes: tuple[torch.Tensor, torch.Tensor], step: torch.Tensor, low: torch.Tensor) -> tuple:
    """Q4_0/Q4_1/Q5_0/Q5_1: one group a block, its first and second 16 levels in two planes."""
    return torch.cat(planes, dim=-1), step, low


def _grid_k(blocks: torch.Tensor, planes: tuple[torch.Tensor, torch.Tensor]) -> tuple:
    """Q4_K/Q5_K: eight groups a block, even and odd ones in two [n, 4, 32] planes; step = d *
    scale, low = -(dmin * min), the products _k_affine rounds to fp32."""
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    levels = torch.stack(planes, dim=2).view(-1, 8 * 32)
    return levels, _f16(blocks, 0) * scales, -(_f16(blocks, 2) * mins)


_GRID_KERNELS: MappingProxyType[int, tuple[int, Callable[[torch.Tensor], tuple]]] = MappingProxyType({
    _T.Q4_0: (4, lambda b: _grid_legacy(_nibble_planes(b[:, 2:]), _f16(b, 0), -8 * _f16(b, 0))),
    _T.Q4_1: (4, lambda b: _grid_legacy(_nibble_planes(b[:, 4:]), _f16(b, 0), _f16(b, 2))),
    _T.Q5_0: (5, lambda b: _grid_legacy(_q5_planes(b, 2), _f16(b, 0), -16 * _f16(b, 0))),
    _T.Q5_1: (5, lambda b: _grid_legacy(_q5_planes(b, 4), _f16(b, 0), _f16(b, 2))),
    _T.Q4_K: (4, lambda b: (*_grid_k(b, _nibble_planes(b[:, 16:].view(-1, 4, 32))), _f16(b, 0), _f16(b, 2),
                            *_k_scales_mins(b[:, 4:16]))),
    _T.Q5_K: (5, lambda b: _grid_k(b, _q5_k_planes(b))),
})


def grid_form(raw: np.ndarray | torch.Tensor, ggml_type: int, shape: tuple[int, ...], *,
              name: str | None = None) -> GridForm | Q6Form | None:
    """A 2-D tensor's GGUF bytes as a GridForm (4/5-bit types), a Q6Form (Q6_K), or None for a type
    the C kernels take as 8-bit groups (F32, Q8_0, ...)."""
    if int(ggml_type) == int(_T.Q6_K) and len(shape) == 2:
        return _q6_form(_as_uint8_tensor(raw), tuple(int(d) for d in shape), name)
    kernel = _GRID_KERNELS.get(int(ggml_type))
    if kernel is None or len(shape) != 2:
        return None
    shape = tuple(int(d) for d in shape)
    data = _as_uint8_tensor(raw)
    _check_request(int(ggml_type), shape, data.numel(), name)
    bits, decode = kernel
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(ggml_type))]
    blocks = data.view(-1, type_size)
    step = max(1, _CHUNK_ELEMENTS // block_size)
    parts = [decode(blocks[start:start + step]) for start in range(0, blocks.shape[0], step)]
    rows, k = shape
    levels, steps, lows, *own = (torch.cat([p[i] for p in parts]) for i in range(len(parts[0])))
    if own:  # Q4_K: its blocks' d and dmin, its groups' scales and mins
        own = [t.reshape(rows, -1).contiguous() for t in own]
        own[:2] = [t.float() for t in own[:2]]
    return GridForm(levels.reshape(rows, k).contiguous(), steps.reshape(rows, k // 32).float(),
                    lows.reshape(rows, k // 32).float(), bits, *own)


@dataclass(frozen=True)
class NibbleForm:
    """A 4-bit tensor's groups as the C kernels pack them, two levels a byte: byte 16g + b of a row
    holds level 32g + b in its low nibble and level 32g + 16 + b in its high one; w = level * step
    + low per group g, the same numbers as its `GridForm`. Q4_0/Q4_1 blocks hold their levels so
    already; Q4_K's are regrouped with a few word operations instead of a byte a level."""

    nibbles: torch.Tensor  # uint8 [rows, k // 2]
    step: torch.Tensor  # fp32 [rows, k // 32]
    low: torch.Tensor  # fp32 [rows, k // 32]
    # Q4_K's own numbers (step = d * scale, low = -(dmin * min)), None for other types:
    d: torch.Tensor | None = None  # fp32 [rows, k // 256], each block's d
    dmin: torch.Tensor | None = None  # fp32 [rows, k // 256]
    scales: torch.Tensor | None = None  # uint8 [rows, k // 32], 0..63
    mins: torch.Tensor | None = None  # uint8 [rows, k // 32], 0..63

    @staticmethod
    def cat(forms: list[NibbleForm]) -> NibbleForm:
        if any(f.scales is None for f in forms):  # a Q4_0/Q4_1 part beside Q4_K ones: steps and lows only
            forms = [replace(f, d=None, dmin=None, scales=None, mins=None) for f in forms]
        return cat_rows(forms)


_LOW_NIBBLES = 0x0F0F0F0F


def _q4_k_nibbles(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K's 128 bytes of levels -> `NibbleForm` bytes. Byte j of each 32-byte chunk c holds level j of
    sub-blocks 2c (low nibble) and 2c + 1 (high): bytes j and 16 + j give a sub-block's byte j."""
    words = _words(blocks[:, 16:]).view(-1, 4, 2, 4)  # [block, c, first / last 16 bytes, word]
    first, last = words[:, :, 0], words[:, :, 1]
    even = (first & _LOW_NIBBLES) | ((last & _LOW_NIBBLES) << 4)
    odd = ((first >> 4) & _LOW_NIBBLES) | (last & ~_LOW_NIBBLES)
    return torch.stack((even, odd), 2).view(torch.uint8).view(-1, 128)


def _k_steps(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's eight steps (d * scale) and lows (-(dmin * min)), as `_grid_k` makes them."""
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    return _f16(blocks, 0) * scales, -(_f16(blocks, 2) * mins)


def _q6_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q6_K blocks -> `Q6Parts` rows: the low 4 bits of ql regrouped as `_q4_k_nibbles` does (bytes
    h*64 + 32*half + j hold level j of groups 4h + half (low nibble) and 4h + 2 + half (high)), the
    top 2 bits from qh (bits 2m of byte h*32 + l: level l of group 4h + m), scales and d."""
    words = _words(blocks[:, 0:128]).view(-1, 2, 2, 2, 4)  # [block, h, half, first / last 16 bytes, word]
    first, last = words[:, :, :, 0], words[:, :, :, 1]
    low = (first & _LOW_NIBBLES) | ((last & _LOW_NIBBLES) << 4)
    high = ((first >> 4) & _LOW_NIBBLES) | (last & ~_LOW_NIBBLES)
    nibbles = torch.stack((low, high), 2).view(torch.uint8).view(-1, 128)  # group 4h + 2 (high) + half
    top = _bits(blocks[:, 128:192].reshape(-1, 32), 2, lshift=0).view(-1, 256)
    return nibbles, top, blocks[:, 192:208].view(torch.int8), _f16(blocks, 208).expand(-1, 8)


@dataclass(frozen=True)
class Q6Parts:
    """A Q6_K tensor's levels as its blocks hold them apart: the low 4 bits two a byte (as
    `NibbleForm`) and the top 2 bits a byte, with Q6Form's scales and d: the same levels, never
    put together a byte each."""

    nibbles: torch.Tensor  # uint8 [rows, k // 2]
    top: torch.Tensor  # uint8 [rows, k], 0..3
    scales: torch.Tensor  # int8 [rows, k // 16]
    d: torch.Tensor  # fp32 [rows, k // 32]

    @staticmethod
    def cat(forms: list[Q6Parts]) -> Q6Parts:
        return cat_rows(forms)


def q6_parts(raw: np.ndarray | torch.Tensor, shape: tuple[int, ...], *, name: str | None = None) -> Q6Parts:
    """A 2-D Q6_K tensor's GGUF bytes as Q6Parts."""
    rows, k = (int(d) for d in shape)
    data = _as_uint8_tensor(raw)
    _check_request(int(_T.Q6_K), (rows, k), data.numel(), name)
    blocks = data.view(-1, GGML_QUANT_SIZES[_T.Q6_K][1])
    n = blocks.shape[0]
    out = (torch.empty(n, 128, dtype=torch.uint8), torch.empty(n, 256, dtype=torch.uint8),
           torch.empty(n, 16, dtype=torch.int8), torch.empty(n, 8))
    chunk = max(1, _CHUNK_ELEMENTS // 256)
    for start in range(0, n, chunk):
        for whole, value in zip(out, _q6_k_parts(blocks[start:start + chunk])):
            whole[start:start + chunk] = value
    return Q6Parts(out[0].view(rows, k // 2), out[1].view(rows, k), out[2].view(rows, k // 16), out[3].view(rows, k // 32))


_NIBBLE_KERNELS: MappingProxyType[int, Callable[[torch.Tensor], tuple]] = MappingProxyType({
    _T.Q4_0: lambda b: (b[:, 2:], _f16(b, 0), -8 * _f16(b, 0)),
    _T.Q4_1: lambda b: (b[:, 4:], _f16(b, 0), _f16(b, 2)),
    _T.Q4_K: lambda b: (_q4_k_nibbles(b), *_k_steps(b), _f16(b, 0), _f16(b, 2), *_k_scales_mins(b[:, 4:16])),
})


def nibble_form(raw: np.ndarray | torch.Tensor, ggml_type: int, shape: tuple[int, ...], *,
                name: str | None = None) -> NibbleForm | None:
    """A 2-D Q4_0/Q4_1/Q4_K tensor's GGUF bytes as a NibbleForm, None for other types."""
    kernel = _NIBBLE_KERNELS.get(int(ggml_type))
    if kernel is None or len(shape) != 2:
        return None
    rows, k = (int(d) for d in shape)
    data = _as_uint8_tensor(raw)
    _check_request(int(ggml_type), (rows, k), data.numel(), name)
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(ggml_type))]
    blocks = data.view(-1, type_size)
    groups = block_size // 32
    n = blocks.shape[0]
    nibbles = torch.empty(n, block_size // 2, dtype=torch.uint8)
    outs = [nibbles, *(torch.empty(n, groups) for _ in range(2))]
    if int(ggml_type) == int(_T.Q4_K):  # and its blocks' d, dmin, scales and mins
        outs += [torch.empty(n, 1), torch.empty(n, 1), *(torch.empty(n, groups, dtype=torch.uint8) for _ in range(2))]
    chunk = max(1, _CHUNK_ELEMENTS // block_size)
    for start in range(0, n, chunk):
        for out, value in zip(outs, kernel(blocks[start:start + chunk])):
            out[start:start + chunk] = value
    per_group, per_block = (rows, k // 32), (rows, k // block_size)
    shapes = [(rows, k // 2), per_group, per_group, per_block, per_block, per_group, per_group]
    return NibbleForm(*(out.view(shape) for out, shape in zip(outs, shapes)))


def _q6_form(data: torch.Tensor, shape: tuple[int, int], name: str | None) -> Q6Form:
    _check_request(int(_T.Q6_K), shape, data.numel(), name)
    blocks = data.view(-1, GGML_QUANT_SIZES[_T.Q6_K][1])
    step = max(1, _CHUNK_ELEMENTS // 256)
    parts = [_q6_k_form(blocks[start:start + step]) for start in range(0, blocks.shape[0], step)]
    rows, k = shape
    levels, scales, d = (torch.cat([p[i] for p in parts]) for i in range(3))
    return Q6Form(levels.reshape(rows, k).contiguous(), scales.reshape(rows, k // 16).contiguous(),
                  d.reshape(rows, k // 32).float().contiguous())


class BlockTensor:
    """A 2-D tensor as the file holds it (its GGUF blocks, a view of the mapping), decoded on demand:
    rows dequantized a chunk at a time, or the C kernels' grid read straight from the blocks. The
    loader hands these out where a matrix's final form is built from the blocks, so no fp32 copy of
    the whole model is made first. `dtype` is the compute dtype the matrix is for."""

    device = torch.device("cpu")

    def __init__(self, raw: np.ndarray | torch.Tensor, ggml_type: int, shape: tuple[int, ...],
                 dtype: torch.dtype = torch.float32, *, name: str | None = None) -> None:
        self.data = _as_uint8_tensor(raw)
        self.ggml_type = int(ggml_type)
        self.shape = torch.Size(int(d) for d in shape)
        self.dtype = dtype
        self.name = name
        if len(self.shape) != 2:
            raise ValueError(f"{_where(name)}a BlockTensor is a matrix, got shape {tuple(self.shape)}")
        _check_request(self.ggml_type, tuple(self.shape), self.data.numel(), name)

    def dense(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole matrix dequantized (`dequantize`), in `dtype` (default the compute dtype)."""
        return dequantize(self.data, self.ggml_type, tuple(self.shape), dtype or self.dtype, name=self.name)

    def rows(self, start: int, end: int) -> torch.Tensor:
        """Rows `start:end` dequantized to fp32: the same numbers as those rows of `dense()`."""
        end = min(end, self.shape[0])
        row_bytes = self.data.numel() // self.shape[0] if self.shape[0] else 0
        return dequantize(self.data[start * row_bytes:end * row_bytes], self.ggml_type, (end - start, self.shape[1]),
                          name=self.name)

    @property
    def grid_bits(self) -> int | None:
        """The bits of `grid()`'s levels (4, 5, 6), None where it has none: known without decoding."""
        if self.ggml_type == int(_T.Q6_K):
            return 6
        kernel = _GRID_KERNELS.get(self.ggml_type)
        return None if kernel is None else kernel[0]

    def grid(self) -> GridForm | Q6Form | None:
        """The 4/5-bit groups or Q6_K blocks as they are in the file (`grid_form`), None for others."""
        return grid_form(self.data, self.ggml_type, tuple(self.shape), name=self.name)

    def nibbles(self) -> NibbleForm | Q6Parts | None:
        """A 4-bit type's groups packed as the C kernels hold them (`nibble_form`), a Q6_K tensor's
        levels in their two parts (`q6_parts`), None for others."""
        if self.ggml_type == int(_T.Q6_K):
            return q6_parts(self.data, tuple(self.shape), name=self.name)
        return nibble_form(self.data, self.ggml_type, tuple(self.shape), name=self.name)

    def __repr__(self) -> str:
        return f"BlockTensor({self.name!r}, {type_name(self.ggml_type)}, {tuple(self.shape)})"


def _dequantize_blocks(data: torch.Tensor, ggml_type: int, dtype: torch.dtype) -> torch.Tensor:
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    kernel = _BLOCK_KERNELS[ggml_type]
    blocks = data.view(-1, type_size)
    n_blocks = blocks.shape[0]
    out = torch.empty(n_blocks, block_size, dtype=dtype)
    step = max(1, _CHUNK_ELEMENTS // block_size)
    scratch = None if dtype == torch.float32 else torch.empty(min(step, n_blocks), block_size)
    for start in range(0, n_blocks, step):
        end = min(start + step, n_blocks)
        if scratch is None:
            kernel(blocks[start:end], out[start:end])
        else:
            kernel(blocks[start:end], scratch[: end - start])
            out[start:end].copy_(scratch[: end - start])
    return out.view(-1)
