"""The forms a weight matrix is held in, one class each with the kernel that multiplies it, and the
matrix side of choosing among them: `choose_forms` (a `Linear`'s) and `embedding_forms` (the token
table's) hand a matrix to the registry (`app/kernels/registry.py`), which declares what each form
accepts and how it is built, in order; here is what a matrix offers it (`Source`: its file's grid,
read from the GGUF types alone for file blocks, its rows, its tensor).

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
from gguf import GGMLQuantizationType

from app.engine.gguf.quants import BlockTensor, GridForm, NibbleForm, Q6Form, Q6Parts, type_name
from app.engine.runtime.kernel_choice import PACKED_EVERYWHERE, KernelChoice, choose_packed_rows
from app.kernels import registry
from app.kernels.cpu_qgemm import CHUNK_ROWS, GROUP, Q4KWeight, Q4Weight, Q5Weight, Q6Weight, Q8Weight, SplitWeight
from app.kernels.registry import EmbeddingRequest, WeightRequest
from app.kernels.settings import KernelSettings
from app.kernels.torch_weights import Fp16Weight, Int4Weight, Int8Weight


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


GroupWeight = Q4Weight | Q5Weight | Q6Weight | Q8Weight | SplitWeight
PackedWeight = Int8Weight | Int4Weight | Fp16Weight | GroupWeight

# The grid each GGUF type's blocks hold, named as the registry's forms; others have none (8-bit groups).
TYPE_LAYOUTS = {"Q4_K": "q4k", "Q4_0": "q4", "Q4_1": "q4", "Q5_0": "q5", "Q5_1": "q5", "Q5_K": "q5", "Q6_K": "q6"}
LAYOUT_BITS = {"q4k": 4, "q4": 4, "q5": 5, "q6": 6}


def layout_of(matrix: Matrix) -> str | None:
    """The grid `matrix`'s file holds it on, as the registry names forms ("q4k", "q4", "q5", "q6";
    "mixed": a fused matrix of parts on several), None if it has none. Known from the GGUF types
    alone for file blocks (a model's plan reads only the headers); a tensor's is its grid, fitted
    from the values where allowed."""
    if isinstance(matrix, FusedMatrix):
        return _fused_layout(matrix.parts)
    if hasattr(matrix, "ggml_type"):  # file blocks (`BlockTensor`), or a header's `TypedMatrix`
        return TYPE_LAYOUTS.get(type_name(matrix.ggml_type))
    return _grid_layout(matrix.grid())


def _fused_layout(parts: Sequence[Matrix]) -> str:
    """Rows of several parts: one 4-bit or Q6_K form where every part is one (Q4_K only where all
    are), 5-bit groups where all are 4/5-bit and one is 5, else "mixed" (each run its own form)."""
    layouts = [layout_of(p) if hasattr(p, "ggml_type") else None for p in parts]
    bits = {LAYOUT_BITS.get(layout) for layout in layouts}
    if bits == {4}:
        return "q4k" if set(layouts) == {"q4k"} else "q4"
    if bits == {6}:
        return "q6"
    return "q5" if None not in bits and 6 not in bits else "mixed"


def _grid_layout(grid: GridForm | Q6Form | None) -> str | None:
    if grid is None:
        return None
    if isinstance(grid, Q6Form):
        return "q6"
    if grid.bits == 4:
        return "q4k" if grid.scales is not None else "q4"
    return "q5"


class Source:
    """A matrix as the registry's forms read it (`registry.WeightSource`): its layout and a tensor's
    fitted grid found once, its dense tensor made once."""

    def __init__(self, matrix: Matrix) -> None:
        self.matrix = matrix
        self.shape, self.dtype, self.device = matrix.shape, matrix.dtype, matrix.device
        self._file = hasattr(matrix, "ggml_type") or isinstance(matrix, FusedMatrix)
        self._found: tuple[str | None, GridForm | Q6Form | None] | None = None
        self._dense: torch.Tensor | None = None

    def layout(self) -> str | None:
        if self._found is None:
            grid = None if self._file else self.matrix.grid()
            self._found = (layout_of(self.matrix) if self._file else _grid_layout(grid), grid)
        return self._found[0]

    def blocks(self) -> GridForm | Q6Form | NibbleForm | Q6Parts | None:
        """The layout's numbers: 4-bit and Q6_K file blocks as they pack (nibbles), 5-bit ones as
        their grid, a tensor's grid as found."""
        layout = self.layout()
        if not self._file:
            return self._found[1]
        return self.matrix.nibbles() if layout in ("q4k", "q4", "q6") else self.matrix.grid()

    def runs(self) -> list[Source]:
        """A fused matrix's runs of consecutive parts of one grid size, each one source."""
        parts = getattr(self.matrix, "parts", [self.matrix])
        runs = [list(run) for _, run in itertools.groupby(parts, key=lambda p: getattr(p, "grid_bits", None))]
        return [Source(run[0] if len(run) == 1 else FusedMatrix(run)) for run in runs]

    def rows(self, start: int, end: int) -> torch.Tensor:
        return self.matrix.rows(start, end)

    def dense(self) -> torch.Tensor:
        if self._dense is None:
            self._dense = self.matrix.dense()
        return self._dense

    def fits_fp16(self) -> bool:
        return bool(self.dense().abs().max() < torch.finfo(torch.float16).max)


class TypedMatrix:
    """A matrix known only from its GGUF header (type, shape): enough for the registry to plan its
    forms without reading its blocks (`kernel_plan.weight_plan`). `blocks` False: the loader will
    hand it out dequantized, with no grid (compute the C kernels do not take)."""

    def __init__(self, ggml_type: int, shape: Sequence[int], dtype: torch.dtype = torch.float32,
                 blocks: bool = True, device: torch.device = torch.device("cpu")) -> None:
        self.ggml_type = int(ggml_type) if blocks else int(GGMLQuantizationType.F32)
        self.shape, self.dtype, self.device = torch.Size(int(d) for d in shape), dtype, device

    @property
    def grid_bits(self) -> int | None:
        return LAYOUT_BITS.get(TYPE_LAYOUTS.get(type_name(self.ggml_type)))


def takes_groups(device: torch.device, dtype: torch.dtype, settings: KernelSettings | None = None) -> bool:
    """Whether matrices on `device` in `dtype` take the C kernels' groups (so the loader hands out
    their blocks): fp32 compute on a CPU, the C kernels asked for and built."""
    return registry.takes_groups(device, dtype, settings)


def group_form(matrix: Matrix, settings: KernelSettings | None = None) -> GroupWeight:
    """The C kernels' copy: the file's own grid (4/5-bit, Q6_K) where there is one, else 8-bit groups
    requantized a chunk of rows at a time (the registry's `weight` op, on a CPU that builds them)."""
    return registry.build("weight", WeightRequest(Source(matrix), settings or KernelSettings()))[1]


@dataclass
class Forms:
    """What a `Linear` holds: the dense `weight` and/or its fbgemm copy `dense` for many rows, a
    `packed` form for up to `choice.packed_max_rows` rows; `plan`: the registry entries chosen."""

    weight: torch.Tensor | None = None
    dense: Fp16Weight | None = None
    packed: PackedWeight | None = None
    choice: KernelChoice = field(default_factory=lambda: KernelChoice(0))
    plan: str = "tensor"


def choose_forms(matrix: Matrix, *, allow_packed: bool = True, requantize_int4: bool = False,
                 settings: KernelSettings | None = None) -> Forms:
    """A matrix's forms, chosen once from the registry: the C kernels' groups for every row count
    where they run (a row's numbers are then the same whatever batch or prefill chunk it is in: no
    crossover to measure); else the dense kernel (the tensor, or its fbgemm fp16 copy) with a packed
    copy for few rows where one wins, at the crossover measured for this shape (`kernel_choice`)."""
    request = WeightRequest(Source(matrix), settings or KernelSettings.from_env(), allow_packed, requantize_int4)
    groups = registry.build("weight", request)
    if groups is not None:
        return Forms(packed=groups[1], choice=KernelChoice(PACKED_EVERYWHERE), plan=groups[0].name)
    many, few = registry.build("weight_many_rows", request), registry.build("weight_few_rows", request)
    weight = request.source.dense()
    dense = many[1] if many[0].name == "fp16" else None
    forms = Forms(weight=None if dense else weight, dense=dense, plan=many[0].name)
    if few is None:
        return forms
    packed = few[1]
    many_rows = dense or (lambda x: F.linear(x, weight))
    forms.choice = choose_packed_rows(packed, many_rows, tuple(weight.shape), weight.dtype, kind=packed.name,
                                      forced=request.settings.linear_kernel)
    if forms.choice.packed_max_rows > 0:  # no copy where it never wins
        forms.packed = packed
        forms.plan += f"+{few[0].name}"
    if forms.choice.packed_max_rows >= PACKED_EVERYWHERE:
        forms.weight = None  # never read: the packed copy serves every row count
    return forms


def embedding_forms(embed: Matrix, head: Forms | object, tied: bool) -> tuple[torch.Tensor | None, GroupWeight | None, str]:
    """The token table as a tensor, or as groups the batch's rows are read from, and the registry
    entry that chose it (the `embedding` op)."""
    entry, (table, rows) = registry.build("embedding", EmbeddingRequest.of(Source(embed), head, tied))
    return table, rows, entry.name


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


def grid_packed(grid: GridForm | Q6Form) -> Q4KWeight | Q4Weight | Q5Weight | Q6Weight:
    """The C kernels' copy of a matrix's 4/5-bit or Q6_K grid: the registry's form for its layout."""
    return registry.FILE_GRIDS[_grid_layout(grid)](grid)


def grid_weight(weight: torch.Tensor, bits: int) -> Q4Weight | Q5Weight | None:
    """`weight` as the C kernels' 4- or 5-bit groups if it sits on such a grid (`fit_grid`), else None."""
    grid = fit_grid(weight, bits)
    return None if grid is None else grid_packed(grid)


def group_weight(weight: torch.Tensor) -> GroupWeight:
    """The C kernels' copy of a tensor: the fewest bits that hold it (8 requantizes)."""
    return group_form(TensorMatrix(weight))

