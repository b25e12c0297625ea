"""Which kernels a model's forward runs, chosen once when the model is built: from the device, the
compute and KV cache dtypes, the model's shapes and what the C library built here. The decoder then
calls what was chosen without asking again per call or per step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from app.engine.gguf.model_config import ModelConfig
from app.kernels import attention_kernels, cpu_attention, cpu_ops


@dataclass(frozen=True)
class KernelPlan:
    rows: str  # "c" (cpu_ops) | "torch": RMS norm, the residual add with it, the MLP's activation
    attention: str  # "c" (cpu_attention) | "triton" | "torch" (the reference): RoPE, KV store, paged attention
    one_call: bool = False  # every layer in one C call (cpu_forward); set by the decoder, which has the weights
    kv_dtype: torch.dtype = torch.float32
    # (unified_attention, store_kv) of a "triton" or "torch" attention; None for "c" (its own fused calls)
    kernels: tuple[Callable, Callable] | None = field(default=None, compare=False)

    def describe(self, backend: str) -> str:
        """`backend` (the device's choice, e.g. "C kernels (AVX2)") with what this model's shapes or
        KV cache left to torch."""
        if not backend.startswith("C kernels") or self.rows == self.attention == "c":
            return backend
        left = " and ".join(name for name, kind in (("row ops", self.rows), ("attention", self.attention)) if kind != "c")
        why = "this model's sizes"
        if self.attention != "c" and self.kv_dtype not in cpu_attention.CACHE_DTYPES:
            why = f"the C attention reads fp32 or fp16 KV caches, not {str(self.kv_dtype).removeprefix('torch.')}"
        return f"{backend}; {left} in torch ({why})"


def plan_kernels(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, kv_dtype: torch.dtype) -> KernelPlan:
    """The rows and attention kernels for this model (`one_call` is the decoder's to add)."""
    widths = [cfg.hidden_size, cfg.intermediate_size] + ([cfg.head_dim] if cfg.qk_norm else [])
    rows = "c" if cpu_ops.takes(device, dtype, widths, cfg.hidden_act) else "torch"
    if cpu_attention.takes(device, dtype, kv_dtype, cfg.num_heads, cfg.head_dim):
        return KernelPlan(rows, "c", kv_dtype=kv_dtype)
    attention = "triton" if device.type == "cuda" else "torch"
    return KernelPlan(rows, attention, kv_dtype=kv_dtype, kernels=attention_kernels(attention))
