"""Row-wise ops of the fp32 CPU path in C (`cpu_ops.c`): RMS norm, optionally after the residual
add, the gated MLP's activation (SiLU or GELU-tanh of the gate, times up), and the greedy
sampler's argmax. Each is one call where torch makes a chain of small ops; a row's numbers do not
depend on the batch. Anything else (bf16, CUDA, odd sizes, no C compiler) stays with torch
(`F.rms_norm`, `F.silu`, `F.gelu`, `argmax`)."""

from __future__ import annotations

import ctypes
import functools

import torch

from app.kernels import cpu_build


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    return cpu_build.load({
        "rms_norm_f32": [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, f32],
        "glu_f32": [ptr, ptr, i64, i64, ctypes.c_int, ctypes.c_int],
        "argmax_rows": [ptr, i64, i64, ptr],
    })


GLU_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # the C kernel's `act` codes


def library() -> ctypes.CDLL | None:
    """The C library with these kernels, None where it does not build here. Where a model's row ops
    run is the registry's to say (`registry`, op `row_ops`)."""
    return _library()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x^2) + eps) * weight` over the last dim (the registry chose the C row ops for the model)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    _call(x, None, None, weight, out, eps)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(x + residual, rms_norm(x + residual))` in one pass (the registry chose the C row ops for the model;
    residual of x's shape and dtype)."""
    x = x.contiguous()
    total, out = torch.empty_like(x), torch.empty_like(x)
    _call(x, residual.contiguous(), total, weight, out, eps)
    return total, out


def _call(x: torch.Tensor, residual: torch.Tensor | None, total: torch.Tensor | None, weight: torch.Tensor,
          out: torch.Tensor, eps: float) -> None:
    dim = x.shape[-1]
    lib = _library()
    lib.rms_norm_f32(x.data_ptr(), None if residual is None else residual.data_ptr(),
                     None if total is None else total.data_ptr(), weight.contiguous().data_ptr(), out.data_ptr(),
                     x.numel() // dim, dim, weight.numel() // dim, eps)


def glu(x: torch.Tensor, act: str) -> torch.Tensor:
    """`act(gate) * up` for `gate, up = x.chunk(2, -1)`, `[M, F]` (the registry chose the C row ops for the model)."""
    x = x.contiguous()
    f = x.shape[1] // 2
    out = torch.empty((x.shape[0], f), dtype=torch.float32)
    _library().glu_f32(x.data_ptr(), out.data_ptr(), x.shape[0], f, GLU_ACTIVATIONS[act], torch.get_num_threads())
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)` for `[M, V]` rows, in C for fp32 CPU rows (faster than torch's CPU
    argmax on a large vocabulary, more so with several rows): the same indices, first maximum and
    NaN included."""
    if not (logits.dtype == torch.float32 and logits.is_cpu and logits.dim() == 2 and _library() is not None):
        return logits.argmax(-1)
    logits = logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    _library().argmax_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr())
    return out
