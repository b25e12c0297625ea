"""A weight matrix and the kernel each batch size uses with it.

Decoding is weight-bandwidth bound. On a bf16 CPU, `torch._weight_int8pack_mm` reads int8 weights
(half the bytes) and dequantises them in the kernel, so it wins at a few rows; it computes rows one
by one, so it loses from some row count on (and badly at prefill sizes). Each matrix shape gets its
crossover measured once per machine (`kernel_choice`); the int8 copy exists only where it wins.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from app.engine.runtime.kernel_choice import KernelChoice, choose_int8_rows


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


class Linear:
    """`y = x @ weight.T + bias`, through the int8 copy for up to `choice.int8_max_rows` rows."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, allow_int8: bool = True) -> None:
        self.weight = weight
        self.bias = bias
        self.int8: Int8Weight | None = None
        self.choice = KernelChoice(0)
        if allow_int8 and Int8Weight.supported(weight):
            int8 = Int8Weight(weight)
            self.choice = choose_int8_rows(int8, lambda x: F.linear(x, weight), tuple(weight.shape), weight.dtype)
            self.int8 = int8 if self.choice.int8_max_rows > 0 else None  # no copy where it never wins

    def uses_int8(self, rows: int) -> bool:
        return self.int8 is not None and self.choice.use_int8(rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.uses_int8(x.shape[0]):
            y = self.int8(x)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)

    def tensors(self, rows: int) -> list[torch.Tensor]:
        """What a forward of `rows` rows reads from memory."""
        read = [self.int8.q, self.int8.scale] if self.uses_int8(rows) else [self.weight]
        return read + ([self.bias] if self.bias is not None else [])

    def resident(self) -> list[torch.Tensor]:
        """Every tensor this matrix keeps in memory (the resident-weight figure)."""
        extra = [self.int8.q, self.int8.scale] if self.int8 is not None else []
        return [self.weight, *extra] + ([self.bias] if self.bias is not None else [])
