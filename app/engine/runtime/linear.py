"""A weight matrix and the kernel each batch size uses with it.

Decoding is weight-bandwidth bound. On a bf16 CPU, `torch._weight_int8pack_mm` reads int8 weights
(half the bytes) and dequantises them in the kernel, so it wins at a few rows; it computes rows one
by one, so it loses from some row count on (and badly at prefill sizes). Each matrix shape gets its
crossover measured once per machine (`kernel_choice`); the packed copy exists only where it wins.

A matrix that came from a 4-bit GGUF type (Q4_0, Q4_1, Q4_K: 16 levels per 32 weights) is packed
as int4 instead (torch's CPU int4 kernel, a bf16 scale and zero per 32 weights): a quarter of the
bf16 bytes, and no new rounding, since its values already lie on that grid. Others (Q5_0, Q6_K,
Q8_0, F32 sources) get int8: re-quantizing them to 4 bits would cost accuracy. The one exception
is a large vocabulary's output projection (`requantize_int4`), where the accuracy was measured.

With fp32 compute (a CPU whose bf16 GEMMs are slower than fp32 ones: AVX2 without AVX512-BF16,
where torch's int4/int8 kernels want bf16 activations too) every matrix keeps its GGUF precision as
4/5/8-bit groups for the C kernels (`cpu_qgemm`) where they build (`group_weight`). Otherwise
(`LOCALBATCH_CPU_QUANT_KERNELS=0`, no C compiler) it is kept as fbgemm's fp16 copy instead of
fp32: half the bytes, fp32 activations in and out, finer rounding than bf16, and as fast as fp32
at prefill sizes. Measured on a 2-core AMD EPYC (AVX2), weights cold: SmolLM2's
3072 x 576 gate/up takes 0.20 / 0.26 / 0.54 / 9.7 ms at 1 / 4 / 16 / 512 rows against fp32's
0.57 / 0.84 / 0.91 / 11.4, Gemma 3's 262k-row head 11.9 / 13.7 / 45 ms at 1 / 4 / 16 against
49 / 125 / 134 (torch's int4 kernel with bf16 activations: 14.0 / 17.1 / 68).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from app.engine.gguf.quants import GridForm, Q6Form
from app.engine.runtime.kernel_choice import PACKED_EVERYWHERE, KernelChoice, choose_packed_rows, dense_forced
from app.kernels import cpu_qgemm
from app.kernels.cpu_qgemm import CHUNK_ROWS, GROUP, Q4Weight, Q5Weight, Q6Weight, Q8Weight


class Int8Weight:
    """int8 weights with one bf16 scale per output row (symmetric, absmax / 127)."""

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.float()
        scale = (w.abs().amax(1) / 127.0).clamp(min=1e-12)
        self.q = torch.round(w / scale.unsqueeze(1)).clamp(-127, 127).to(torch.int8).contiguous()
        self.scale = scale.to(torch.bfloat16)

    @staticmethod
    def supported(weight: torch.Tensor) -> bool:
        return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and hasattr(torch, "_weight_int8pack_mm")

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

    GROUP = 32
    # A 4-bit source rebuilt from its bf16 copy misses by bf16 rounding (measured ≤ 0.07 of a
    # level step on SmolLM2's Q4_1 matrices); a 5-bit or finer one misses by up to half a step.
    _TOLERANCE = 0.2

    def __init__(self, packed: torch.Tensor, scale_zero: torch.Tensor, out_features: int) -> None:
        self.q = packed
        self.scale = scale_zero  # [in_features / GROUP, out_features, 2] bf16
        self.out_features = out_features

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

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.float().contiguous(), None)

    @staticmethod
    def supported(weight: torch.Tensor) -> bool:
        return (weight.device.type == "cpu" and weight.dtype == torch.float32
                and "fbgemm" in torch.backends.quantized.supported_engines
                and hasattr(torch.ops.quantized, "linear_dynamic_fp16"))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty((0, self.out_features))
        return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * 2


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


def grid_weight(weight: torch.Tensor, bits: int) -> Q4Weight | Q5Weight | None:
    """`weight` as the C kernels' 4- or 5-bit groups if every group of 32 already sits on 16 or 32
    evenly spaced levels (a dequantized Q4_0/Q4_1/Q4_K or Q5_0/Q5_1 tensor), else None."""
    n, k = weight.shape
    levels, steps, lows = [], [], []
    for start in range(0, n, CHUNK_ROWS):
        fit = _grid_fit(weight[start : start + CHUNK_ROWS].float().view(-1, k // GROUP, GROUP), (1 << bits) - 1)
        if fit is None:
            return None
        q, step, low = fit
        levels.append(q.to(torch.uint8).view(-1, k))
        steps.append(step.view(-1, k // GROUP))
        lows.append(low.view(-1, k // GROUP))
    return grid_packed(GridForm(torch.cat(levels), torch.cat(steps), torch.cat(lows), bits))


def grid_packed(grid: GridForm | Q6Form) -> Q4Weight | Q5Weight | Q6Weight:
    """The C kernels' copy of a matrix read from 4/5-bit or Q6_K GGUF blocks."""
    if isinstance(grid, Q6Form):
        return Q6Weight(grid.levels, grid.scales, grid.d)
    return (Q4Weight if grid.bits == 4 else Q5Weight)(grid.levels, grid.step, grid.low)


def takes_grids(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether matrices on `device` in `dtype` go to the C kernels' groups (so the loader should
    read their grids)."""
    return device.type == "cpu" and dtype == torch.float32 and cpu_qgemm.enabled()


def group_weight(weight: torch.Tensor) -> Q4Weight | Q5Weight | Q8Weight:
    """The C kernels' copy of `weight`: the fewest bits that hold it (8 requantizes)."""
    return grid_weight(weight, 4) or grid_weight(weight, 5) or Q8Weight(weight)


PackedWeight = Int8Weight | Int4Weight | Fp16Weight | Q4Weight | Q5Weight | Q6Weight | Q8Weight


class Linear:
    """`y = x @ weight.T + bias`, through the packed copy (int4, int8) for up to
    `choice.packed_max_rows` rows and the dense kernel above: the weight itself, or with fp32
    compute on a CPU its fbgemm fp16 copy (as fast as fp32 from one row to prefill sizes, half the
    bytes), which then replaces it. With the C kernels (`cpu_qgemm`) the 4/5/8-bit groups are the
    only copy and serve every row count."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, allow_packed: bool = True,
        requantize_int4: bool = False, grid: GridForm | Q6Form | None = None, fit_grid: bool = True,
    ) -> None:
        """`grid`: the weight's 4/5-bit groups (or Q6_K blocks) as the file holds them, taken as they
        are by the C kernels. Without one, `fit_grid` looks for a 4/5-bit grid in the values (a source read
        without grids); False: the loader knows there is none (Q6_K, Q8_0), so 8-bit groups."""
        self.weight: torch.Tensor | None = weight
        self.bias = bias
        self.dense: Fp16Weight | None = None
        self.packed: PackedWeight | None = None
        self.choice = KernelChoice(0)
        if not allow_packed or dense_forced():
            return
        if _takes_group_weights(weight):
            # The only copy, and every row count goes through the C kernels: a row's numbers are
            # then the same whatever batch or prefill chunk it is in (no crossover to measure).
            self.packed = grid_packed(grid) if grid else group_weight(weight) if fit_grid else Q8Weight(weight)
            self.weight = None
            self.choice = KernelChoice(PACKED_EVERYWHERE)
            return
        if Fp16Weight.supported(weight):
            self.dense, self.weight = Fp16Weight(weight), None
        packed = _packed_copy(weight, requantize_int4)
        if packed is None:
            return
        kind = "int4" if isinstance(packed, Int4Weight) else "int8"
        self.choice = choose_packed_rows(packed, self._dense, tuple(weight.shape), weight.dtype, kind=kind)
        self.packed = packed if self.choice.packed_max_rows > 0 else None  # no copy where it never wins
        if self.choice.packed_max_rows >= PACKED_EVERYWHERE:
            self.weight = None  # never read: the packed copy serves every row count

    def uses_packed(self, rows: int) -> bool:
        return self.packed is not None and self.choice.use_packed(rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.uses_packed(x.shape[0])
        if self.weight is not None and not packed:
            return F.linear(x, self.weight, self.bias)
        y = self.packed(x) if packed else self._dense(x)
        return y if self.bias is None else y + self.bias

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        """Above the crossover: the dense weight or its fp16 copy."""
        if self.dense is not None:
            return self.dense(x)
        return F.linear(x, self.weight)

    def tensors(self, rows: int) -> list[torch.Tensor | PackedWeight]:
        """What a forward of `rows` rows reads from memory (tensors, or a packed weight as a whole)."""
        read = [self.packed if self.uses_packed(rows) else self._dense_source()]
        return read + ([self.bias] if self.bias is not None else [])

    def _dense_source(self) -> torch.Tensor | PackedWeight:
        return next(t for t in (self.dense, self.weight, self.packed) if t is not None)

    def resident(self) -> list[torch.Tensor | PackedWeight]:
        """Every tensor or packed weight this matrix keeps in memory (the resident-weight figure)."""
        return [t for t in (self.weight, self.dense, self.packed, self.bias) if t is not None]


def _takes_group_weights(weight: torch.Tensor) -> bool:
    """fp32 compute on a CPU, the C kernels asked for and built, whole groups of 32."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.shape[1] % GROUP == 0
            and cpu_qgemm.enabled())


def _packed_copy(weight: torch.Tensor, requantize_int4: bool) -> PackedWeight | None:
    """The packed copy a CPU weight gets with bf16 compute: torch's int4 for a 4-bit source (or a
    requantized head), else int8. None where none applies (CUDA, fp16, fp32)."""
    if not Int8Weight.supported(weight):
        return None
    return (Int4Weight.from_grid(weight) or (Int4Weight.requantized(weight) if requantize_int4 else None)
            or Int8Weight(weight))


def nbytes(item: torch.Tensor | PackedWeight) -> int:
    if isinstance(item, torch.Tensor):
        return item.numel() * item.element_size()
    return item.nbytes


def storage_key(item: torch.Tensor | PackedWeight) -> int:
    """One key per memory block: a tied head's weight is the embedding's storage."""
    return item.data_ptr() if isinstance(item, torch.Tensor) else id(item)
