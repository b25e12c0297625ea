"""torch's own weight-quantized GEMMs, each wrapped as a weight form (`y = form(x)`, its bytes, its
name): int8 and int4 weights for bf16 activations on a CPU (`torch._weight_int8pack_mm`,
`aten._weight_int4pack_mm_for_cpu`) and fbgemm's fp16 GEMM for fp32 activations. The registry
(`registry.py`) says where each is taken; the crossover against the dense kernel is measured per
machine (`runtime/kernel_choice.py`)."""

from __future__ import annotations

import torch

from app.kernels.cpu_qgemm import CHUNK_ROWS


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
    def available() -> bool:
        """This torch has the int8 weight GEMM (the registry asks for bf16 CPU compute besides)."""
        return hasattr(torch, "_weight_int8pack_mm")

    @staticmethod
    def supported(weight: torch.Tensor) -> bool:
        return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and Int8Weight.available()

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
    def available() -> bool:
        """This torch has fbgemm's fp16 GEMM (the registry asks for fp32 CPU compute besides)."""
        return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(torch.ops.quantized, "linear_dynamic_fp16")

    @staticmethod
    def supported(weight: torch.Tensor) -> bool:
        return weight.device.type == "cpu" and weight.dtype == torch.float32 and Fp16Weight.available()

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
