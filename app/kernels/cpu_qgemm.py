"""Weight-quantized CPU GEMMs (`cpu_qgemm.c`) for fp32 compute on x86 CPUs with AVX2 (and AVX-512
VNNI's vpdpbusd where the CPU has it, chosen at run time: `isa`): Q6_K and Q4_K at their own bits and
numbers, 4- and 5-bit (Q4_1 / Q5_1-style, d * level + m; Q4_0 / Q5_0 without a stored m) and 8-bit
(d * level) weights in groups of 32, with the activations quantized per group of 32 to int8 inside
the kernel, as llama.cpp multiplies on the CPU.

Torch has nothing like it for such machines: its int4/int8 weight kernels want bf16 activations
(slow without AVX512-BF16), and fbgemm's fp16 GEMM reads 16 bits a weight.

Every row count goes through these loops, prefill chunks too: each output is summed from its own
row in the same order whatever the batch, so with the C attention (`cpu_attention`) a sequence's
numbers are the same alone, batched, chunked or from the prefix cache, bit for bit (quantized
activations would otherwise carry an fp32 difference of 1e-7 upstream across a rounding boundary
and grow it). The weights take about the GGUF file's size, a fraction of fp16's; teacher-forced
against llama.cpp they agree on the top token (tests/engine/test_oracle.py), and prefill-sized
batches run faster than fbgemm's fp16 (figures in docs/tuning.md).

The default wherever the fp32 path runs and the kernels build (a CPU without fast bf16: the
start-up probe picks fp32 compute there); `LOCALBATCH_CPU_QUANT_KERNELS=0` keeps fbgemm's fp16
weights instead (three times the memory, batched runs equal to alone ones only up
to near-ties).

The C source ships in the package and is compiled once per machine into the user cache dir at the
first start, with the system C compiler. Without a compiler, or on a CPU without AVX2/FMA/F16C,
`enabled()` is False and fbgemm's fp16 weights serve instead.

`fake_quantize` and `dequantize_ref` are the torch references; the tests hold the kernels to
`fake_quantize(x) @ dequantize_ref().T`.
"""

from __future__ import annotations

import abc
import ctypes
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from app.kernels import cpu_build
from app.kernels.cpu_memory import HUGE_PAGE, huge_page_region
from app.kernels.settings import QUANT_KERNELS_ENV, KernelSettings

GROUP = 32
CHUNK_ROWS = 4096  # rows packed at a time: fp32 temporaries stay small even for a 262k-row head
ENABLE_ENV = QUANT_KERNELS_ENV  # "0": fp32 compute takes fbgemm's fp16 weights instead (read in `settings`)


def enabled(settings: KernelSettings | None = None) -> bool:
    """Not turned off (`LOCALBATCH_CPU_QUANT_KERNELS=0`), and built here."""
    return (settings or KernelSettings.from_env()).quant_kernels and _library() is not None


def library() -> ctypes.CDLL | None:
    """The C library with the GEMM, None where it does not build here."""
    return _library()


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    ptr = ctypes.c_void_p
    return cpu_build.load({"qgemm": [ptr, ptr, ctypes.c_int64, ptr, ctypes.c_int], "qgemm_isa": [],
                           "qgemm_set_isa": [ctypes.c_int]},
                          restypes={"qgemm": ctypes.c_int, "qgemm_isa": ctypes.c_int, "qgemm_set_isa": ctypes.c_int})


ISA_NAMES = {0: "AVX2", 1: "AVX-512 VNNI"}


def isa() -> str | None:
    """The instruction set the GEMM tiles run with here ("AVX2", "AVX-512 VNNI"), None without the
    kernels. Chosen once from what the CPU confirms (cpuid and the OS's saved registers)."""
    lib = _library()
    return None if lib is None else ISA_NAMES[lib.qgemm_isa()]


def set_isa(name: str) -> bool:
    """Run the tiles with `name` from now on ("AVX2" or "AVX-512 VNNI"); False where this CPU
    lacks it (nothing changes then). Both give the same bits: tests run each where it can."""
    lib = _library()
    code = {v: k for k, v in ISA_NAMES.items()}[name]
    return lib is not None and lib.qgemm_set_isa(code) == 0


class _QWeight(ctypes.Structure):
    """The kernel's `qweight`: a matrix's shape and tensors, passed as one pointer a call."""

    _fields_ = [("K", ctypes.c_int64), ("N", ctypes.c_int64), ("qs", ctypes.c_void_p), ("d", ctypes.c_void_p),
                ("m", ctypes.c_void_p), ("qh", ctypes.c_void_p), ("sc", ctypes.c_void_p), ("fmt", ctypes.c_int64),
                ("next", ctypes.c_void_p)]


FORMATS = {"q8": 0, "q4": 1, "q5": 2, "q6": 3, "q4k": 4, "q4_0": 5, "q5_0": 6}  # each form's name -> cpu_kernels.h's QG_* code


def fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """x `[M, K]` as the kernels see it: per group of 32, scale = absmax / 127, levels rounded to
    nearest (ties to even), times the scale again."""
    g = x.float().reshape(x.shape[0], -1, GROUP)
    d = g.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(g * inv) * d).view(x.shape[0], -1)


TILE = 8  # the kernels' weights and scale tables come in tiles of 8 rows


def tile_rows(t: torch.Tensor) -> torch.Tensor:
    """A `[rows, G]` table as the kernels read it: `[ceil(rows / 8), G, 8]`, element (row, g) at
    `[row // 8, g, row % 8]`, the last tile padded with zeros."""
    rows, groups = t.shape
    padded = F.pad(t, (0, 0, 0, -rows % TILE))
    return padded.view(-1, TILE, groups).transpose(1, 2).contiguous()


def _tile_at(t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a table tiled as `tile_rows` (`[tiles, G, 8, ...]`): `[len(ids), G, ...]`."""
    return t[ids // TILE, :, ids % TILE]


class _GroupWeight(abc.ABC):
    out_features: int
    in_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step makes ~120 of these calls: one ctypes call with five arguments (the C side
        # keeps the quantized activations' scratch), a small share of a small matrix's time.
        if x.dim() != 2 or x.shape[1] != self.in_features:  # the kernel would read past x
            raise ValueError(f"expected rows of {self.in_features} inputs, got a tensor of shape {tuple(x.shape)}")
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.to(torch.float32).contiguous()
        y = torch.empty((x.shape[0], self.out_features), dtype=torch.float32)
        if x.shape[0] and _library().qgemm(self._desc_ptr, x.data_ptr(), x.shape[0], y.data_ptr(),
                                          torch.get_num_threads()):
            raise MemoryError(f"no memory for the quantized activations of {x.shape[0]} rows")
        return y

    _TENSORS = ("qs", "d")

    def _describe(self) -> None:
        """The C side's view of this matrix (again whenever its tensors move)."""
        m, qh, sc = (getattr(self, name, None) for name in ("m", "qh", "sc"))
        self._desc = _QWeight(self.in_features, self.out_features, self.qs.data_ptr(), self.d.data_ptr(),
                              *(None if t is None else t.data_ptr() for t in (m, qh, sc)), FORMATS[self.name])
        self._desc_ptr = ctypes.addressof(self._desc)

    @abc.abstractmethod
    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` dequantized, fp32 (a tied embedding read from the output projection's copy)."""

    def dequantize_ref(self) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features))


def _lanes(q: torch.Tensor, vectors: int) -> torch.Tensor:
    """Per-row groups `[n, G, vectors * 4]` (bytes) as the kernels read them: `[tiles, G, vectors,
    8, 4]`, so that in each 32-byte vector lane j carries row j's four bytes."""
    n, groups = q.shape[:2]
    q = F.pad(q, (0, 0, 0, 0, 0, -n % TILE)).view(-1, TILE, groups, vectors, 4)
    return q.permute(0, 2, 3, 1, 4).contiguous()


def _or_shifted(fields: torch.Tensor, width: int) -> torch.Tensor:
    """uint8 fields `[..., F]` of `width` bits packed into one byte, field f at bit f * width."""
    out = fields[..., 0].clone(memory_format=torch.contiguous_format)
    for f in range(1, fields.shape[-1]):
        out |= fields[..., f] << (f * width)
    return out


def _lane_rows(qs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a `_lanes` layout: `[len(ids), G, vectors * 4]`."""
    return qs[ids // TILE, :, :, ids % TILE].flatten(2)


class Q4Weight(_GroupWeight):
    """w = d * level + m per group of 32 (level 0..15, d and m fp16): 5 bits a weight, as a Q4_1
    GGUF tensor stores it. Laid out for the kernel (`cpu_qgemm.c`): `qs [tiles, G, 4, 8, 4]`,
    byte b of row j in vector s holding level 4s+b | level 16+4s+b << 4; d and m tiled as
    `tile_rows`. Where every m is -8 d (a Q4_0 tensor: "q4_0") m is not stored (4.5 bits a weight,
    as the file) but made in the kernel, exactly."""

    name = "q4"

    _TENSORS = ("qs", "d", "m")
    _OFFSET = -8  # Q4_0's m over d

    def __init__(self, levels: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> None:
        n, k = levels.shape
        g = levels.view(n, k // GROUP, 2, GROUP // 2).to(torch.uint8)
        self._pack(g[:, :, 0] | (g[:, :, 1] << 4), d, m)

    @staticmethod
    def from_nibbles(nibbles: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> Q4Weight:
        """From levels already two a byte, `nibbles [n, k / 2]`: byte 16g + b holds level 32g + b
        (low nibble) and 32g + 16 + b (high), as Q4_0/Q4_1 blocks store them."""
        self = Q4Weight.__new__(Q4Weight)  # 4 bits only: a Q5Weight needs its 5th bits too
        self._pack(nibbles.view(nibbles.shape[0], -1, GROUP // 2), d, m)
        return self

    def _pack(self, nibbles: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> None:
        """`nibbles [n, G, 16]` and per-group d and m `[n, G]` into the kernel's tiles."""
        n, groups = nibbles.shape[:2]
        self.out_features, self.in_features, self.groups = n, groups * GROUP, groups
        self.qs = _lanes(nibbles, 4)
        d, m = d.to(torch.float16), m.to(torch.float16)
        if torch.equal(m.float(), d.float() * self._OFFSET):  # Q4_0 / Q5_0: m from d in the kernel
            self.name, self._TENSORS = type(self).name + "_0", tuple(t for t in type(self)._TENSORS if t != "m")
            self.m = None
        else:
            self.m = tile_rows(m)
        self.d = tile_rows(d)
        self._describe()

    def levels(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 levels `[N, K/32, 32]` (of rows `ids`, if given)."""
        ids = torch.arange(self.out_features) if ids is None else ids
        halves = _lane_rows(self.qs, ids)
        return torch.cat((halves & 0x0F, halves >> 4), -1)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        d = _tile_at(self.d, ids).float().unsqueeze(-1)
        m = d * self._OFFSET if self.m is None else _tile_at(self.m, ids).float().unsqueeze(-1)
        return (self.levels(ids).float() * d + m).view(-1, self.in_features)

    @property
    def nbytes(self) -> int:
        return self.qs.numel() + 2 * (self.d.numel() + (0 if self.m is None else self.m.numel()))


K_BLOCK = 256  # weights per k-quant block (Q4_K, Q6_K): one d each


class Q4KWeight(Q4Weight):
    """A Q4_K tensor at its own numbers: w = (d * scale) * level - (dmin * min) per group of 32, d
    and dmin fp16 per block of 256 (8 groups), scale and min 0..63 per group: 4.625 bits a weight
    (the file's 4.5 packs the 6-bit pairs tighter), and exact, where `Q4Weight`'s fp16 step and low
    per group would round the products. Laid out as `Q4Weight`'s nibbles; `sc [tiles, G, 2, 8]`
    uint8 (a tile's 8 scales, then its 8 mins); d and -dmin `[tiles, G / 8, 8]` as `tile_rows`."""

    name = "q4k"

    _TENSORS = ("qs", "d", "m", "sc")

    def __init__(self, levels: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, scales: torch.Tensor,
                 mins: torch.Tensor) -> None:
        """levels `[n, k]` (0..15), d and dmin `[n, k / 256]`, scales and mins `[n, k / 32]` (0..63)."""
        n, k = levels.shape
        g = levels.view(n, k // GROUP, 2, GROUP // 2).to(torch.uint8)
        self._pack_k(g[:, :, 0] | (g[:, :, 1] << 4), d, dmin, scales, mins)

    @staticmethod
    def from_nibbles(nibbles: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, scales: torch.Tensor,
                     mins: torch.Tensor) -> Q4KWeight:
        """From levels two a byte (`nibbles [n, k / 2]`, as `Q4Weight.from_nibbles`)."""
        self = Q4KWeight.__new__(Q4KWeight)
        self._pack_k(nibbles.view(nibbles.shape[0], -1, GROUP // 2), d, dmin, scales, mins)
        return self

    def _pack_k(self, nibbles: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, scales: torch.Tensor,
                mins: torch.Tensor) -> None:
        n, groups = nibbles.shape[:2]
        if groups % (K_BLOCK // GROUP) or d.shape != (n, groups * GROUP // K_BLOCK) or d.shape != dmin.shape:
            raise ValueError(f"a Q4_K matrix's rows are whole blocks of {K_BLOCK} with one d and dmin each")
        self.out_features, self.in_features, self.groups = n, groups * GROUP, groups
        self.qs = _lanes(nibbles, 4)
        self.d = tile_rows(d.to(torch.float16))
        self.m = tile_rows((-dmin).to(torch.float16))
        self.sc = tile_rows(torch.stack((scales, mins), -1).to(torch.uint8).flatten(1))
        self._describe()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        d, m = (_tile_at(t, ids).float().repeat_interleave(K_BLOCK // GROUP, -1) for t in (self.d, self.m))
        pairs = _tile_at(self.sc, ids).view(len(ids), self.groups, 2).float()
        step, low = d * pairs[..., 0], m * pairs[..., 1]
        return (self.levels(ids).float() * step.unsqueeze(-1) + low.unsqueeze(-1)).view(-1, self.in_features)

    @property
    def nbytes(self) -> int:
        return self.qs.numel() + 2 * (self.d.numel() + self.m.numel()) + self.sc.numel()


class Q5Weight(Q4Weight):
    """w = d * level + m per group of 32 with levels 0..31 (Q5_0 / Q5_1 blocks: d and m fp16), 6
    bits a weight: `Q4Weight`'s nibbles plus the 5th bits, `qh [tiles, G, 32]`: byte 4j+b, bit
    2s+p holds the 5th bit of row j's level 16p+4s+b (the nibbles' vector s, plane p)."""

    name = "q5"

    _TENSORS = ("qs", "qh", "d", "m")
    _OFFSET = -16  # Q5_0's m over d: "q5_0", 5.5 bits a weight

    def __init__(self, levels: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> None:
        n, k = levels.shape
        levels = levels.to(torch.uint8)
        fifth = (levels >> 4).view(n, k // GROUP, 2, 4, 4)  # [n, G, p, s, b]
        fifth = F.pad(fifth, (0, 0, 0, 0, 0, 0, 0, 0, 0, -n % TILE)).view(-1, TILE, k // GROUP, 2, 4, 4)
        bits = fifth.permute(0, 2, 1, 5, 4, 3).reshape(-1, k // GROUP, 4 * TILE, 8)  # [tiles, G, 4j+b, 2s+p]
        self.qh = _or_shifted(bits, 1)
        super().__init__(levels & 0x0F, d, m)

    def levels(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        ids = torch.arange(self.out_features) if ids is None else ids
        lanes = self.qh[ids // TILE].view(len(ids), -1, TILE, 4)[torch.arange(len(ids)), :, ids % TILE]  # [len, G, b]
        bits = (lanes.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1  # [len, G, b, 2s+p]
        fifth = bits.view(len(ids), -1, 4, 4, 2).permute(0, 1, 4, 3, 2).flatten(2)  # [len, G, 16p+4s+b]
        return super().levels(ids) | (fifth << 4)

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.qh.numel()


def _block_d(d: torch.Tensor) -> torch.Tensor:
    """Per-group d `[n, G]` as one fp16 per block of 8 groups `[n, G / 8]`; a ValueError if it is
    not the same over each block (not a Q6_K tensor's)."""
    n, groups = d.shape
    per = K_BLOCK // GROUP
    if groups % per:
        raise ValueError(f"a Q6_K matrix's rows are whole blocks of {K_BLOCK}, not {groups * GROUP}")
    blocks = d.reshape(n, groups // per, per)
    if not torch.equal(blocks, blocks[..., :1].expand_as(blocks)):
        raise ValueError("a Q6_K matrix's d differs within a block of 256 weights")
    return blocks[..., 0].to(torch.float16)


class Q6Weight(_GroupWeight):
    """A Q6_K tensor at its own bits: w = d * sc * (level - 32), level 0..63, an int8 sub-scale `sc`
    per 16 weights and d (fp16) per block of 256 (Q6_K's): 6.5625 bits a weight as in the file (8.5
    as 8-bit groups), and exact. Laid out for the kernel: `qs [tiles, G, 192]` bytes, q4's 128
    bytes of low nibbles then 64 of the top two bits (vector s // 2, byte 4j+b, bits 2k..2k+1 with
    k = 2 (s % 2) + p: row j's level 16p+4s+b); `sc [tiles, G, 8, 2]`; d `[tiles, G / 8, 8]`, tiled
    as `tile_rows`."""

    name = "q6"

    _TENSORS = ("qs", "sc", "d")

    def __init__(self, levels: torch.Tensor, scales: torch.Tensor, d: torch.Tensor) -> None:
        """levels uint8 `[n, k]` (0..63), scales int8 `[n, k / 16]`, d `[n, k / 32]`, the same over
        each 8 groups (a block's d: k a multiple of 256)."""
        n, k = levels.shape
        levels = levels.to(torch.uint8)
        g = levels.view(n, k // GROUP, 2, GROUP // 2)
        self._pack((g[:, :, 0] & 0x0F) | ((g[:, :, 1] & 0x0F) << 4), levels >> 4, scales, d)

    @staticmethod
    def from_parts(nibbles: torch.Tensor, top: torch.Tensor, scales: torch.Tensor, d: torch.Tensor) -> Q6Weight:
        """From the levels' low 4 bits two a byte (`nibbles [n, k / 2]`, as `Q4Weight.from_nibbles`)
        and their top 2 bits a byte (`top [n, k]`), as a Q6_K tensor's blocks give them apart."""
        self = Q6Weight.__new__(Q6Weight)
        self._pack(nibbles.view(nibbles.shape[0], -1, GROUP // 2), top, scales, d)
        return self

    def _pack(self, nibbles: torch.Tensor, top: torch.Tensor, scales: torch.Tensor, d: torch.Tensor) -> None:
        """`nibbles [n, G, 16]`, `top [n, k]` (0..3), scales and d into the kernel's tiles."""
        n, groups = nibbles.shape[:2]
        self.out_features, self.in_features, self.groups = n, groups * GROUP, groups
        low = _lanes(nibbles, 4).view(-1, groups, 128)
        top = top.reshape(n, groups, 2, 4, 4)  # [n, G, p, s, b]
        top = F.pad(top, (0, 0, 0, 0, 0, 0, 0, 0, 0, -n % TILE)).view(-1, TILE, groups, 2, 2, 2, 4)  # p, s//2, s%2
        fields = top.permute(0, 2, 4, 1, 6, 5, 3)  # [tiles, G, s//2, j, b, s%2, p]: bits 2(2(s%2)+p)
        packed = _or_shifted(fields.flatten(-2), 2).reshape(-1, groups, 64)
        self.qs = torch.cat((low, packed), -1).contiguous()
        self.sc = tile_rows(scales.to(torch.int8).view(n, groups, 2).flatten(1).view(torch.int16)).view(torch.int8)
        self.d = tile_rows(_block_d(d))
        self._describe()

    def levels(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 levels 0..63 `[N, K/32, 32]` (of rows `ids`, if given)."""
        ids = torch.arange(self.out_features) if ids is None else ids
        nib = _lane_rows(self.qs[:, :, :128].unflatten(2, (4, TILE, 4)), ids)  # [len, G, 4s+b]
        low = torch.cat((nib & 0x0F, nib >> 4), -1)  # [len, G, 16p+4s+b]
        top = _lane_rows(self.qs[:, :, 128:].unflatten(2, (2, TILE, 4)), ids)  # [len, G, 4 (s//2) + b]
        bits = (top.unsqueeze(-1) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)) & 3  # [len, G, s//2, b, 2(s%2)+p]
        bits = bits.view(len(ids), self.groups, 2, 4, 2, 2).permute(0, 1, 5, 2, 4, 3).flatten(2)  # [len, G, p, s//2, s%2, b]
        return low | (bits << 4)

    def scales(self, ids: torch.Tensor) -> torch.Tensor:
        """The sub-scales of rows `ids`, int8 `[len(ids), K/16]`."""
        return _tile_at(self.sc.view(torch.int16), ids).view(torch.int8).view(len(ids), -1)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        d = _tile_at(self.d, ids).float().repeat_interleave(K_BLOCK // 16, -1)  # per 16
        w = (self.levels(ids).float() - 32).view(len(ids), -1, 16)
        return (w * (d * self.scales(ids).float()).unsqueeze(-1)).view(-1, self.in_features)

    @property
    def nbytes(self) -> int:
        return self.qs.numel() + self.sc.numel() + self.d.numel() * 2


class Q8Weight(_GroupWeight):
    """w = d * level per group of 32 (level -127..127, d fp16 = the group's absmax / 127): 8.5 bits
    a weight. Exact for a Q8_0 tensor; within half a level (1/254 of the group's range) for any
    other. Laid out for the kernel: `qs [tiles, G, 8, 8, 4]` (vector s, lane j: row j's levels
    4s .. 4s+3), d tiled as `tile_rows`."""

    name = "q8"

    def __init__(self, weight: torch.Tensor) -> None:
        self._fill(weight.shape, lambda start, end: weight[start:end])

    @classmethod
    def from_rows(cls, shape: tuple[int, int], rows: Callable[[int, int], torch.Tensor]) -> Q8Weight:
        """From a matrix read `rows(start, end)` at a time (fp32 rows decoded from a file's blocks):
        the same bytes as from the whole matrix, without it."""
        self = cls.__new__(cls)
        self._fill(shape, rows)
        return self

    def _fill(self, shape: tuple[int, int], rows: Callable[[int, int], torch.Tensor]) -> None:
        n, k = shape
        self.out_features, self.in_features, self.groups = n, k, k // GROUP
        self.qs = torch.empty((-(-n // TILE), self.groups, GROUP // 4, TILE, 4), dtype=torch.int8)
        d = torch.empty((n, self.groups), dtype=torch.float16)
        for start in range(0, n, CHUNK_ROWS):  # a multiple of TILE: chunks start on a tile
            w = rows(start, start + CHUNK_ROWS).float().view(-1, self.groups, GROUP)
            scale = (w.abs().amax(-1) / 127.0).half()
            inv = torch.where(scale > 0, 1.0 / scale.float(), torch.zeros_like(scale, dtype=torch.float32))
            q = torch.round(w * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
            tiles = _lanes(q, GROUP // 4)
            self.qs[start // TILE : start // TILE + tiles.shape[0]] = tiles
            d[start : start + CHUNK_ROWS] = scale
        self.d = tile_rows(d)
        self._describe()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        q, d = _lane_rows(self.qs, ids).float(), _tile_at(self.d, ids).float().unsqueeze(-1)
        return (q * d).view(-1, self.in_features)

    @property
    def nbytes(self) -> int:
        return self.qs.numel() + self.d.numel() * 2


MAX_PARTS = 4  # cpu_qgemm.c's MAX_PARTS


class SplitWeight(_GroupWeight):
    """One matrix as blocks of rows in forms of their own: a fused q/k/v whose v is Q6_K beside Q4_K
    q and k keeps each part at its file's bits (one form for all would be 8-bit groups). The kernel
    quantizes the activations once and writes each part's outputs beside the others' (`qweight`'s
    `next` chain), so a call costs what one matrix of the same size does."""

    name = "split"
    _TENSORS = ()

    def __init__(self, parts: list[_GroupWeight]) -> None:
        if (len({p.in_features for p in parts}) != 1 or any(isinstance(p, SplitWeight) for p in parts)
                or not 2 <= len(parts) <= MAX_PARTS):
            raise ValueError(f"a SplitWeight is 2 to {MAX_PARTS} plain group weights of one input width")
        self.parts = parts
        self.out_features, self.in_features = sum(p.out_features for p in parts), parts[0].in_features
        self._describe()

    def _describe(self) -> None:
        """Copies of the parts' descriptors, chained (again after `consolidate` moved their
        tensors): each part alone still multiplies only its own rows."""
        self._descs = [_QWeight.from_buffer_copy(p._desc) for p in self.parts]
        for a, b in zip(self._descs, self._descs[1:]):
            a.next = ctypes.addressof(b)
        self._desc_ptr = ctypes.addressof(self._descs[0])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty((len(ids), self.in_features))
        start = 0
        for p in self.parts:
            mine = (ids >= start) & (ids < start + p.out_features)
            if mine.any():
                out[mine] = p.rows(ids[mine] - start)
            start += p.out_features
        return out

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


C_FORMS = (Q4Weight, Q5Weight, Q6Weight, Q8Weight, SplitWeight)  # every form `qgemm` takes (Q4KWeight is a Q4Weight)


def consolidate(weights: list[_GroupWeight]) -> None:
    """Move the weights' tensors into one anonymous mapping, in the order given (the order a
    forward reads them), advised for transparent huge pages where Linux has them.

    A decode step streams every weight once: with 4 KiB pages that is ~25k TLB misses and a
    prefetcher that stops at every page boundary. On 2 MiB pages the layer matrices (each under
    2 MiB) are read as one stream, and decode's GEMMs get faster (docs/tuning.md). Nothing changes
    where huge pages are off (`never`). A `SplitWeight`'s parts move, then it chains them again."""
    splits = [w for w in weights if isinstance(w, SplitWeight)]
    weights = [p for w in weights for p in (w.parts if isinstance(w, SplitWeight) else [w])]
    tensors = [getattr(w, name) for w in weights for name in w._TENSORS]
    if not tensors:
        return
    total = sum(-(-t.nbytes // 64) * 64 for t in tensors)  # each tensor 64-byte aligned
    arena = torch.frombuffer(huge_page_region(total + HUGE_PAGE), dtype=torch.uint8)  # keeps the mapping alive
    offset = -arena.data_ptr() % HUGE_PAGE
    for w in weights:
        for name in w._TENSORS:
            t = getattr(w, name)
            setattr(w, name, arena[offset : offset + t.nbytes].view(t.dtype).view(t.shape).copy_(t))
            offset += -(-t.nbytes // 64) * 64
        w._describe()
    for w in splits:
        w._describe()
