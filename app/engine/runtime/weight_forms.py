"""The forms a weight matrix is held in, one class each with the kernel that multiplies it, and the
one place that picks a matrix's forms (`choose_forms`) when the model is built.

| form | kernel | where |
|---|---|---|
| the tensor itself (fp32, bf16, fp16) | `F.linear` | CUDA; bf16 CPU rows above the crossover; `LOCALBATCH_LINEAR_KERNEL=dense` |
| `Fp16Weight` | fbgemm's fp16 GEMM | fp32 compute on a CPU without the C kernels |
| `Int8Weight` | torch's int8 weight GEMM | bf16 CPU, up to the measured crossover |
| `Int4Weight` | torch's int4 weight GEMM | bf16 CPU, a 4-bit source (or a large head), up to the crossover |
| `Q4KWeight` | the C kernels (`cpu_qgemm`) | fp32 CPU: a Q4_K tensor (read from its blocks), every row count |
| `Q4Weight` / `Q5Weight` | the C kernels | fp32 CPU: another 4/5-bit GGUF type, every row count |
| `Q6Weight` | the C kernels | fp32 CPU: a Q6_K tensor |
| `Q8Weight` | the C kernels | fp32 CPU: anything else (Q8_0, F16) |
| `SplitWeight` | the C kernels | fp32 CPU: a fused q/k/v of mixed types, each run of parts in its form |

A matrix arrives as a `Matrix`: a tensor (`TensorMatrix`: random weights, a bf16 or CUDA load), the
file's blocks (`BlockTensor`: the C kernels' path, whose forms are built from the blocks without an
fp32 copy of the whole matrix) or rows of several (`FusedMatrix`: q/k/v, gate/up). The C kernels'
forms read it rows at a time or as its grid; the others take it dense.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from app.engine.gguf.quants import BlockTensor, GridForm, NibbleForm, Q6Form, Q6Parts
from app.engine.runtime.kernel_choice import PACKED_EVERYWHERE, KernelChoice, choose_packed_rows, dense_forced
from app.kernels import cpu_qgemm
from app.kernels.cpu_qgemm import CHUNK_ROWS, GROUP, Q4KWeight, Q4Weight, Q5Weight, Q6Weight, Q8Weight, SplitWeight


class WeightForm(Protocol):
    """What every form offers: `y = form(x)` (`x [rows, in_features]`), its bytes and its name (the
    kernel-choice cache keys int4 measurements by it)."""

    name: str
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    @property
    def nbytes(self) -> int: ...


class Matrix(Protocol):
    """A weight matrix before it takes a form: its shape and compute dtype, the whole of it, fp32
    rows a chunk at a time, and its 4/5/6-bit grid where the source knows one."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    def dense(self) -> torch.Tensor: ...

    def rows(self, start: int, end: int) -> torch.Tensor: ...

    def grid(self) -> GridForm | Q6Form | None: ...

    def nibbles(self) -> NibbleForm | Q6Parts | None: ...


class TensorMatrix:
    """A matrix given as a tensor. `grid`: its groups as its GGUF blocks held them; without one,
    `fit_grid` looks for a 4/5-bit grid in the values (a source read without grids), False: there is
    none to find (the file said so), so 8-bit groups."""

    def __init__(self, weight: torch.Tensor, grid: GridForm | Q6Form | None = None, fit_grid: bool = True) -> None:
        self.weight, self._grid, self._fit = weight, grid, fit_grid
        self.shape, self.dtype, self.device = weight.shape, weight.dtype, weight.device

    def dense(self) -> torch.Tensor:
        return self.weight

    def rows(self, start: int, end: int) -> torch.Tensor:
        return self.weight[start:end].float()

    def grid(self) -> GridForm | Q6Form | None:
        if self._grid is not None or not self._fit:
            return self._grid
        return fit_grid(self.weight, 4) or fit_grid(self.weight, 5)

    def nibbles(self) -> NibbleForm | Q6Parts | None:
        return None  # a tensor's grid is fitted or given as levels (`grid`)


class FusedMatrix:
    """Matrices stacked by rows (q/k/v, gate/up), read part by part: no concatenated fp32 copy."""

    def __init__(self, parts: Sequence[Matrix]) -> None:
        self.parts = list(parts)
        self.shape = torch.Size((sum(p.shape[0] for p in parts), parts[0].shape[1]))
        self.dtype, self.device = parts[0].dtype, parts[0].device

    def dense(self) -> torch.Tensor:
        return torch.cat([p.dense() for p in self.parts])

    def rows(self, start: int, end: int) -> torch.Tensor:
        out, offset = [], 0
        for part in self.parts:
            n = part.shape[0]
            lo, hi = max(start - offset, 0), min(end - offset, n)
            if lo < hi:
                out.append(part.rows(lo, hi))
            offset += n
        return torch.cat(out) if len(out) > 1 else out[0]

    def grid(self) -> GridForm | Q6Form | None:
        # Decoding every part's grid only to find no common one (a Q6_K v beside Q4_K q and k) is wasted.
        bits = {p.grid_bits if isinstance(p, BlockTensor) else -1 for p in self.parts}
        if None in bits or -1 in bits or (6 in bits and len(bits) > 1):
            return None
        return GridForm.cat([p.grid() for p in self.parts])

    def nibbles(self) -> NibbleForm | Q6Parts | None:
        bits = {p.grid_bits if isinstance(p, BlockTensor) else None for p in self.parts}
        if bits not in ({4}, {6}):
            return None
        return (NibbleForm if bits == {4} else Q6Parts).cat([p.nibbles() for p in self.parts])


def as_matrix(weight: torch.Tensor | Matrix, grid: GridForm | Q6Form | None = None, fit_grid: bool = True) -> Matrix:
    return TensorMatrix(weight, grid, fit_grid) if isinstance(weight, torch.Tensor) else weight


def fused(parts: Sequence[torch.Tensor | Matrix], grids: dict | None = None, names: Sequence[str] = ()) -> Matrix:
    """Row-stacked `parts` as one matrix. Tensors are concatenated as before (their grids from
    `grids` by `names`, or fitted on the whole where `grids` is None); file blocks stay apart."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        weight = torch.cat(list(parts)) if len(parts) > 1 else parts[0]
        grid = GridForm.cat([grids.get(n) for n in names]) if grids is not None else None
        return TensorMatrix(weight, grid, fit_grid=grids is None)
    matrices = [as_matrix(p, fit_grid=False) for p in parts]
    return matrices[0] if len(matrices) == 1 else FusedMatrix(matrices)


class Int8Weight:
    """int8 weights with one bf16 scale per output row (symmetric, absmax / 127)."""

    name = "int8"

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.float()
        scale = (w.abs().amax(1) / 127.0).clamp(min=1e-12)
        self.q = torch.round(w / scale.unsqueeze(1)).clamp(-127, 127).to(torch.int8).contiguous()
        self.scale = scale.to(torch.bfloat16)
        self.out_features = self.q.shape[0]

    @staticmethod
    def supported(weight: torch.Tensor) -> bool:
        return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and hasattr(torch, "_weight_int8pack_mm")

    @classmethod
    def build(cls, weight: torch.Tensor, requantize_int4: bool = False) -> Int8Weight | None:
        return cls(weight) if cls.supported(weight) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty((0, self.q.shape[0]))
        return torch._weight_int8pack_mm(x.to(torch.bfloat16), self.q, self.scale)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size()


class Int4Weight:
    """4-bit weights for `torch.ops.aten._weight_int4pack_mm_for_cpu`: groups of `GROUP` along each
    row, w = (q - 8) * scale + zero with bf16 scale and zero per group. Made by `from_grid` (a
    4-bit source) or `requantized` (any source)."""

    name = "int4"
    GROUP = 32
    # A 4-bit source rebuilt from its bf16 copy misses by bf16 rounding (a small share of a level
    # step: docs/tuning.md); a 5-bit or finer one misses by up to half a step.
    _TOLERANCE = 0.2

    def __init__(self, packed: torch.Tensor, scale_zero: torch.Tensor, out_features: int) -> None:
        self.q = packed
        self.scale = scale_zero  # [in_features / GROUP, out_features, 2] bf16
        self.out_features = out_features

    @classmethod
    def build(cls, weight: torch.Tensor, requantize_int4: bool = False) -> Int4Weight | None:
        """A bf16 CPU matrix on a 4-bit grid, or any such one with `requantize_int4`."""
        if not Int8Weight.supported(weight):
            return None
        return cls.from_grid(weight) or (cls.requantized(weight) if requantize_int4 else None)

    @classmethod
    def from_grid(cls, weight: torch.Tensor) -> Int4Weight | None:
        """The int4 copy of `weight` if every group of 32 already holds at most 16 evenly spaced
        levels (a dequantized Q4 tensor), else None. Checked chunk by chunk, so a matrix that is
        not 4-bit costs one chunk."""
        return cls._pack(weight, check=True)

    @classmethod
    def requantized(cls, weight: torch.Tensor) -> Int4Weight | None:
        """`weight` rounded to 16 evenly spaced levels per group of 32 (min to max), whatever its
        source: new rounding error, so only where its accuracy was measured. None where torch's
        int4 kernel does not take the shape."""
        return cls._pack(weight, check=False)

    @classmethod
    def _pack(cls, weight: torch.Tensor, check: bool) -> Int4Weight | None:
        n, k = weight.shape
        if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") or k % cls.GROUP or n % 16:
            return None
        levels, scale_zero = [], []
        for start in range(0, n, CHUNK_ROWS):  # the grid check's fp32 temporaries stay small
            found = cls._grid(weight[start : start + CHUNK_ROWS], check)
            if found is None:
                return None
            levels.append(found[0])
            scale_zero.append(found[1])
        try:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.cat(levels), 1)
        except RuntimeError:
            return None  # a shape or build this torch's int4 kernel does not take
        return cls(packed, torch.cat(scale_zero, 1).contiguous(), n)

    @classmethod
    def _grid(cls, rows: torch.Tensor, check: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(levels int32 `[rows, k]`, scale/zero `[k / GROUP, rows, 2]`), or None if `check` and
        the rows are off the grid."""
        w = rows.float().view(rows.shape[0], -1, cls.GROUP)
        q, step, low = grid_levels(w)
        scale_zero = torch.cat((step, low + 8 * step), -1).to(torch.bfloat16)  # as the kernel reads them
        if check:
            rebuilt = (q - 8) * scale_zero[..., :1].float() + scale_zero[..., 1:].float()
            if bool(((rebuilt - w).abs() > cls._TOLERANCE * step).any()):
                return None
        return q.to(torch.int32).view(rows.shape), scale_zero.transpose(0, 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty((0, self.out_features))
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.q, self.GROUP, self.scale)

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()


class Fp16Weight:
    """fbgemm's fp16 GEMM (`quantized::linear_dynamic_fp16`): the weight packed as fp16, fp32
    activations in and out. No activation quantization: a row's numbers depend on the rest of the
    batch only through fp32 summation order, as with the dense fp32 GEMM."""

    name = "fp16"

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.float().contiguous(), None)

    @staticmethod
    def supported(weight: torch.Tensor) -> bool:
        return (weight.device.type == "cpu" and weight.dtype == torch.float32
                and "fbgemm" in torch.backends.quantized.supported_engines
                and hasattr(torch.ops.quantized, "linear_dynamic_fp16"))

    @classmethod
    def build(cls, weight: torch.Tensor) -> Fp16Weight | None:
        return cls(weight) if cls.supported(weight) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty((0, self.out_features))
        return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * 2


GroupWeight = Q4Weight | Q5Weight | Q6Weight | Q8Weight | SplitWeight
PackedWeight = Int8Weight | Int4Weight | Fp16Weight | GroupWeight

# Tried in order for a matrix with bf16 compute on a CPU: the first that takes it is the packed copy
# for few rows (up to the measured crossover).
FEW_ROWS_FORMS: tuple[type[Int4Weight] | type[Int8Weight], ...] = (Int4Weight, Int8Weight)


def takes_groups(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether matrices on `device` in `dtype` take the C kernels' groups (so the loader hands out
    their blocks): fp32 compute on a CPU, the C kernels asked for and built."""
    return device.type == "cpu" and dtype == torch.float32 and cpu_qgemm.enabled()


def group_form(matrix: Matrix) -> GroupWeight:
    """The C kernels' copy: the file's own grid (4/5-bit, Q6_K) where there is one, else 8-bit groups
    requantized a chunk of rows at a time."""
    return file_groups(matrix) or Q8Weight.from_rows(matrix.shape, matrix.rows)


def file_groups(matrix: Matrix) -> Q4KWeight | Q4Weight | Q5Weight | Q6Weight | SplitWeight | None:
    """The C kernels' copy of a matrix at its file's own bits (4/5-bit groups, Q6_K; a fused one of
    mixed types split into runs), None if it has none: 4-bit and Q6_K blocks have their levels
    regrouped as they are packed, never a byte a level."""
    nibbles = matrix.nibbles()
    if isinstance(nibbles, NibbleForm) and nibbles.scales is not None:  # Q4_K: its own numbers, exact
        return Q4KWeight.from_nibbles(nibbles.nibbles, nibbles.d, nibbles.dmin, nibbles.scales, nibbles.mins)
    if isinstance(nibbles, NibbleForm):
        return Q4Weight.from_nibbles(nibbles.nibbles, nibbles.step, nibbles.low)
    if isinstance(nibbles, Q6Parts):
        return Q6Weight.from_parts(nibbles.nibbles, nibbles.top, nibbles.scales, nibbles.d)
    grid = matrix.grid()
    if grid is not None:
        return grid_packed(grid)
    return split_groups(matrix) if isinstance(matrix, FusedMatrix) else None


def split_groups(matrix: FusedMatrix) -> SplitWeight | None:
    """A fused matrix whose parts have no one grid (a Q6_K v beside Q4_K q and k): each run of parts
    of one grid size in its own form (`group_form`), None where that keeps no part at its file's bits."""
    runs = [list(run) for _, run in itertools.groupby(matrix.parts, key=lambda p: getattr(p, "grid_bits", None))]
    if not 2 <= len(runs) <= cpu_qgemm.MAX_PARTS:
        return None
    forms = [group_form(run[0] if len(run) == 1 else FusedMatrix(run)) for run in runs]
    return None if all(isinstance(f, Q8Weight) for f in forms) else SplitWeight(forms)


def grid_packed(grid: GridForm | Q6Form) -> Q4KWeight | Q4Weight | Q5Weight | Q6Weight:
    """The C kernels' copy of a matrix read from 4/5-bit or Q6_K GGUF blocks."""
    if isinstance(grid, Q6Form):
        return Q6Weight(grid.levels, grid.scales, grid.d)
    if grid.scales is not None and grid.bits == 4:  # Q4_K: its own numbers, exact
        return Q4KWeight(grid.levels, grid.d, grid.dmin, grid.scales, grid.mins)
    return (Q4Weight if grid.bits == 4 else Q5Weight)(grid.levels, grid.step, grid.low)


@dataclass
class Forms:
    """What a `Linear` holds: the dense `weight` and/or its fbgemm copy `dense` for many rows, a
    `packed` form for up to `choice.packed_max_rows` rows."""

    weight: torch.Tensor | None = None
    dense: Fp16Weight | None = None
    packed: PackedWeight | None = None
    choice: KernelChoice = field(default_factory=lambda: KernelChoice(0))


def choose_forms(matrix: Matrix, *, allow_packed: bool = True, requantize_int4: bool = False) -> Forms:
    """A matrix's forms, chosen once: the C kernels' groups for every row count where they run;
    else the dense kernel (the tensor, or its fbgemm fp16 copy) with a packed copy for few rows
    where one wins, at the crossover measured for this shape (`kernel_choice`)."""
    if not allow_packed or dense_forced():
        return Forms(weight=matrix.dense())
    if takes_groups(matrix.device, matrix.dtype) and matrix.shape[1] % GROUP == 0:
        # The only copy, and every row count goes through the C kernels: a row's numbers are then
        # the same whatever batch or prefill chunk it is in (no crossover to measure).
        return Forms(packed=group_form(matrix), choice=KernelChoice(PACKED_EVERYWHERE))
    weight = matrix.dense()
    dense = Fp16Weight.build(weight)
    forms = Forms(weight=None if dense else weight, dense=dense)
    packed = next((p for p in (form.build(weight, requantize_int4) for form in FEW_ROWS_FORMS) if p is not None), None)
    if packed is None:
        return forms
    many_rows = dense or (lambda x: F.linear(x, weight))
    forms.choice = choose_packed_rows(packed, many_rows, tuple(weight.shape), weight.dtype, kind=packed.name)
    if forms.choice.packed_max_rows > 0:  # no copy where it never wins
        forms.packed = packed
    if forms.choice.packed_max_rows >= PACKED_EVERYWHERE:
        forms.weight = None  # never read: the packed copy serves every row count
    return forms


def grid_levels(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups `[..., 32]` on 16 evenly spaced levels from min to max: (levels 0..15 as floats, step,
    min), w ~ levels * step + min. Both 4-bit packings (torch's int4, the C kernels' q4) use it."""
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    step = ((high - low) / 15).clamp(min=1e-12)
    return torch.round((w - low) / step).clamp(0, 15), step, low


# A group sits on a grid when every value is within 5% of a step of a level: the fp16 step and low
# alone stay below 1% (2^-12 of 31 levels, or of a low 60 steps from 0); a wrong grid misses by a
# quarter step or more.
GRID_TOLERANCE = 0.05


def _fit_error(w: torch.Tensor, step: torch.Tensor, low: torch.Tensor, top: int) -> tuple[torch.Tensor, ...]:
    """Groups `w [..., 32]` on levels 0..top of (step, low) as the kernel reads them (fp16): the
    worst error of each group in steps, the levels, the step, the low."""
    step, low = step.half().float(), low.half().float()
    step = torch.where(torch.isfinite(step) & (step != 0), step, torch.ones_like(step))
    q = torch.round((w - low) / step).clamp(0, top)
    return ((q * step + low - w).abs() / step.abs()).amax(-1, keepdim=True), q, step, low


def _grid_fit(w: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Groups `w [rows, G, 32]` as levels 0..top times an fp16 step plus an fp16 low, as GGUF blocks
    are: Q4_1/Q5_1 span min to max; Q4_0/Q5_0 put the largest magnitude on level 0 (step = -it / 8
    or / 16: negative when it is positive). A K-quant's sub-block (Q4_K) need not reach either
    end: where neither fits, the step is the smallest gap between the group's values, from its
    minimum (a sort, for those groups only). None if some group fits nothing within
    `GRID_TOLERANCE`."""
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    peak = w.gather(-1, w.abs().argmax(-1, keepdim=True))
    fit = _fit_error(w, (high - low) / top, low, top)
    other = _fit_error(w, -peak / ((top + 1) // 2), peak, top)
    fit = tuple(torch.where(other[0] < fit[0], o, f) for o, f in zip(other, fit))
    miss = (fit[0] > GRID_TOLERANCE).squeeze(-1)
    if bool(miss.any()):
        rest, rest_low = w[miss], low[miss]
        # A sample first: data on no grid fails it in a few ms instead of a sort of the whole chunk.
        for part in (slice(0, 256), slice(None)) if len(rest) > 256 else (slice(None),):
            gaps = rest[part].sort(-1).values.diff(dim=-1)
            gap = _fit_error(rest[part], torch.where(gaps > 0, gaps, torch.inf).amin(-1, keepdim=True), rest_low[part], top)
            if bool((gap[0] > GRID_TOLERANCE).any()):
                return None
        for whole, found in zip(fit, gap):
            whole[miss] = found
    return fit[1], fit[2], fit[3]


def fit_grid(weight: torch.Tensor, bits: int) -> GridForm | None:
    """`weight`'s groups of 32 as 16 or 32 evenly spaced levels if every group already sits on such
    a grid (a dequantized Q4_0/Q4_1/Q4_K or Q5_0/Q5_1 tensor), else None."""
    n, k = weight.shape
    if k % GROUP:
        return None
    levels, steps, lows = [], [], []
    for start in range(0, n, CHUNK_ROWS):
        fit = _grid_fit(weight[start : start + CHUNK_ROWS].float().view(-1, k // GROUP, GROUP), (1 << bits) - 1)
        if fit is None:
            return None
        q, step, low = fit
        levels.append(q.to(torch.uint8).view(-1, k))
        steps.append(step.view(-1, k // GROUP))
        lows.append(low.view(-1, k // GROUP))
    return GridForm(torch.cat(levels), torch.cat(steps), torch.cat(lows), bits)


def grid_weight(weight: torch.Tensor, bits: int) -> Q4Weight | Q5Weight | None:
    """`weight` as the C kernels' 4- or 5-bit groups if it sits on such a grid (`fit_grid`), else None."""
    grid = fit_grid(weight, bits)
    return None if grid is None else grid_packed(grid)


def group_weight(weight: torch.Tensor) -> GroupWeight:
    """The C kernels' copy of a tensor: the fewest bits that hold it (8 requantizes)."""
    return group_form(TensorMatrix(weight))


def dense_of(matrix: torch.Tensor | Matrix) -> torch.Tensor:
    return matrix if isinstance(matrix, torch.Tensor) else matrix.dense()
