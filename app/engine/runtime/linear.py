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
4/5/6/8-bit groups for the C kernels (`cpu_qgemm`) where they build, built from the file's blocks.
The forms are declared in the registry (`app/kernels/registry.py`); `weight_forms` asks it. Otherwise
(`LOCALBATCH_CPU_QUANT_KERNELS=0`, no C compiler) it is kept as fbgemm's fp16 copy instead of
fp32: half the bytes, fp32 activations in and out, finer rounding than bf16, faster than fp32 at
a few rows and as fast at prefill sizes (figures in docs/tuning.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from app.engine.gguf.quants import GridForm, Q6Form
from app.engine.runtime.weight_forms import Fp16Weight, Matrix, PackedWeight, as_matrix, choose_forms
from app.kernels.settings import KernelSettings

__all__ = ["Linear", "nbytes", "storage_key"]


class Linear:
    """`y = x @ weight.T + bias`, through the packed copy (int4, int8) for up to
    `choice.packed_max_rows` rows and the dense kernel above: the weight itself, or with fp32
    compute on a CPU its fbgemm fp16 copy (as fast as fp32 from one row to prefill sizes, half the
    bytes), which then replaces it. With the C kernels (`cpu_qgemm`) the 4/5/6/8-bit groups are the
    only copy and serve every row count. The forms are chosen once, by the registry (`weight_forms.choose_forms`)."""

    def __init__(
        self, weight: torch.Tensor | Matrix, bias: torch.Tensor | None = None, *, allow_packed: bool = True,
        requantize_int4: bool = False, grid: GridForm | Q6Form | None = None, fit_grid: bool = True,
        settings: KernelSettings | None = None,
    ) -> None:
        """`weight`: a tensor, or a matrix still in the file's blocks (`BlockTensor`, `FusedMatrix`).
        `grid`: a tensor's 4/5-bit groups (or Q6_K blocks) as the file holds them, taken as they are
        by the C kernels. Without one, `fit_grid` looks for a 4/5-bit grid in the values (a source
        read without grids); False: the loader knows there is none (Q6_K, Q8_0), so 8-bit groups.
        `settings`: as the model read them (default: read now)."""
        forms = choose_forms(as_matrix(weight, grid, fit_grid), allow_packed=allow_packed,
                             requantize_int4=requantize_int4, settings=settings)
        self.weight: torch.Tensor | None = forms.weight
        self.bias = bias
        self.dense: Fp16Weight | None = forms.dense
        self.packed: PackedWeight | None = forms.packed
        self.choice = forms.choice
        self.plan = forms.plan  # the registry entries chosen, e.g. "q4k", "fp16", "tensor+int8"

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


def nbytes(item: torch.Tensor | PackedWeight) -> int:
    if isinstance(item, torch.Tensor):
        return item.numel() * item.element_size()
    return item.nbytes


def storage_key(item: torch.Tensor | PackedWeight) -> int:
    """One key per memory block: a tied head's weight is the embedding's storage."""
    return item.data_ptr() if isinstance(item, torch.Tensor) else id(item)
