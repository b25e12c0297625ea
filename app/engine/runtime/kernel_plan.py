"""Which kernels a model's forward runs, chosen once when the model is built: from the device, the
compute and KV cache dtypes, the model's shapes and what the C library built here. The decoder then
calls what was chosen without asking again per call or per step."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from app.engine.gguf.model_config import ModelConfig
from app.kernels import attention_kernels, cpu_attention, cpu_ops


class RowOps(str, enum.Enum):
    """Who runs the row ops: RMS norm, the residual add with it, the MLP's activation."""

    C = "c"  # cpu_ops
    TORCH = "torch"


class Attention(str, enum.Enum):
    """Who runs RoPE, the KV store and paged attention."""

    C = "c"  # cpu_attention's fused calls
    TRITON = "triton"
    TORCH = "torch"  # the reference


@dataclass(frozen=True)
class KernelPlan:
    rows: RowOps
    attention: Attention
    one_call: bool = False  # every layer in one C call (cpu_forward); set by the decoder, which has the weights
    kv_dtype: torch.dtype = torch.float32
    # A TRITON or TORCH attention's kernels, filled in from `attention` (C has its own fused calls).
    unified_attention: Callable | None = field(default=None, compare=False)
    store_kv: Callable | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", RowOps(self.rows))
        object.__setattr__(self, "attention", Attention(self.attention))
        if self.attention is not Attention.C and self.unified_attention is None:
            unified_attention, store_kv = attention_kernels(self.attention.value)
            object.__setattr__(self, "unified_attention", unified_attention)
            object.__setattr__(self, "store_kv", store_kv)

    def describe(self, backend: str) -> str:
        """`backend` (the device's choice, e.g. "C kernels (AVX2)") with what this model's shapes or
        KV cache left to torch."""
        if not backend.startswith("C kernels") or (self.rows is RowOps.C and self.attention is Attention.C):
            return backend
        left = " and ".join(name for name, ours in (("row ops", self.rows is RowOps.C),
                                                    ("attention", self.attention is Attention.C)) if not ours)
        why = "this model's sizes"
        if self.attention is not Attention.C and self.kv_dtype not in cpu_attention.CACHE_DTYPES:
            why = f"the C attention reads fp32, fp16 or int8 KV caches, not {str(self.kv_dtype).removeprefix('torch.')}"
        return f"{backend}; {left} in torch ({why})"


def plan_kernels(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, kv_dtype: torch.dtype) -> KernelPlan:
    """The rows and attention kernels for this model (`one_call` is the decoder's to add)."""
    widths = [cfg.hidden_size, cfg.intermediate_size] + ([cfg.head_dim] if cfg.qk_norm else [])
    rows = RowOps.C if cpu_ops.takes(device, dtype, widths, cfg.hidden_act) else RowOps.TORCH
    if cpu_attention.takes(device, dtype, kv_dtype, cfg.num_heads, cfg.head_dim):
        return KernelPlan(rows, Attention.C, kv_dtype=kv_dtype)
    return KernelPlan(rows, Attention.TRITON if device.type == "cuda" else Attention.TORCH, kv_dtype=kv_dtype)
