"""The environment variables that steer the kernel and weight-form choices, read in this one place
(`KernelSettings.from_env`). A model reads them once, when it is built (its plan keeps them); the
per-call attention dispatch of callers without a plan (tests, benchmarks) reads them per call.

| variable | values | what it does |
|---|---|---|
| `LOCALBATCH_LINEAR_KERNEL` | `auto` (default), `dense`, `packed` (or `int8`) | `dense`: every matrix as loaded, no packed or fp16 copy (exact fp32 math: what the model tests compare with a reference); `packed`: the few-rows copy (int4/int8) at every row count, nothing measured |
| `LOCALBATCH_CPU_QUANT_KERNELS` | `1` (default), `0` | `0`: fp32 compute keeps fbgemm's fp16 weights instead of the C kernels' 4/5/6/8-bit groups |
| `LOCALBATCH_CPU_ATTENTION` | `c` (default), `torch` | `torch`: the reference attention, RoPE and KV store instead of the C kernels (for comparisons) |
| `LOCALBATCH_CPU_ATTENTION_BF16` | `0` (default), `1` | `1`: the C attention's dot products in bf16 (vdpbf16ps) where the CPU has AVX512_BF16, every row (`cpu_attention.bf16_attention`); off by default: no faster on a prompt, slower on a decode (docs/tuning.md) |
| `LOCALBATCH_CPU_ISA` | unset, `avx2` | `avx2`: the AVX2 GEMM tiles even where the CPU has AVX-512 VNNI (read by the C library itself at its first GEMM, `cpu_qgemm.c`), and the fp32 attention: an AVX2-only machine's kernels |
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

LINEAR_KERNEL_ENV = "LOCALBATCH_LINEAR_KERNEL"
QUANT_KERNELS_ENV = "LOCALBATCH_CPU_QUANT_KERNELS"
ATTENTION_ENV = "LOCALBATCH_CPU_ATTENTION"
ATTENTION_BF16_ENV = "LOCALBATCH_CPU_ATTENTION_BF16"
ISA_ENV = "LOCALBATCH_CPU_ISA"
ENV_VARS = (LINEAR_KERNEL_ENV, QUANT_KERNELS_ENV, ATTENTION_ENV, ATTENTION_BF16_ENV, ISA_ENV)


@dataclass(frozen=True)
class KernelSettings:
    """What the user asked of the kernel choice; the defaults let the registry choose."""

    linear_kernel: str = "auto"  # "auto" | "dense" | "packed"
    quant_kernels: bool = True  # the C kernels' groups for fp32 compute
    c_attention: bool = True  # the C attention where it takes the model
    attention_bf16: bool = False  # its dot products in bf16 where the CPU has AVX512_BF16
    isa: str | None = None  # "avx2" forces the AVX2 tiles (the C library reads it)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KernelSettings:
        env = os.environ if environ is None else environ
        linear = env.get(LINEAR_KERNEL_ENV, "auto")
        return cls(
            linear_kernel="packed" if linear == "int8" else linear,
            quant_kernels=env.get(QUANT_KERNELS_ENV, "1") != "0",
            c_attention=env.get(ATTENTION_ENV, "c") != "torch",
            attention_bf16=env.get(ATTENTION_BF16_ENV, "0") == "1",
            isa=env.get(ISA_ENV) or None,
        )

    @property
    def dense_forced(self) -> bool:
        return self.linear_kernel == "dense"

    def describe(self) -> str:
        """The variables set away from their defaults, for people ("defaults" if none)."""
        changed = [(LINEAR_KERNEL_ENV, self.linear_kernel, "auto"), (QUANT_KERNELS_ENV, "1" if self.quant_kernels else "0", "1"),
                   (ATTENTION_ENV, "c" if self.c_attention else "torch", "c"),
                   (ATTENTION_BF16_ENV, "1" if self.attention_bf16 else "0", "0"), (ISA_ENV, self.isa, None)]
        return " ".join(f"{name}={value}" for name, value, default in changed if value != default) or "defaults"
