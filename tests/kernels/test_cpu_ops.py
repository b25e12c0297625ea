"""The C RMS norm and gated activation of the fp32 CPU path (app/kernels/cpu_ops.c) against torch's."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from app.engine.runtime import decoder
from app.engine.runtime.kernel_plan import RowOps
from app.kernels import cpu_ops, registry
from app.kernels.registry import RowRequest

pytestmark = pytest.mark.skipif(
    cpu_ops._library() is None, reason="no C compiler or no AVX2/FMA/F16C here: the C kernels cannot build"
)


def test_rms_norm_matches_torch_and_rows_are_batch_invariant() -> None:
    x, w = torch.randn(7, 576) * 3, torch.randn(576)
    out = cpu_ops.rms_norm(x, w, 1e-6)
    assert torch.allclose(out, F.rms_norm(x, (576,), w, 1e-6), rtol=1e-5, atol=1e-5)
    assert torch.equal(out[2:3], cpu_ops.rms_norm(x[2:3], w, 1e-6))


def test_add_rms_norm_returns_the_sum_and_its_norm_and_leaves_inputs_alone() -> None:
    x, h, w = torch.randn(4, 64), torch.randn(4, 64), torch.randn(64)
    before = x.clone()
    total, normed = cpu_ops.add_rms_norm(x, h, w, 1e-5)
    assert torch.equal(x, before)
    assert torch.equal(total, x + h)
    assert torch.allclose(normed, F.rms_norm(x + h, (64,), w, 1e-5), rtol=1e-5, atol=1e-5)


def test_per_head_weights_on_a_strided_view() -> None:
    """q/k norm: [tokens, heads, head_dim] with a weight row per head, from a slice of a fused qkv."""
    qkv = torch.randn(3, 7, 32)
    qk, w = qkv[:, :5], torch.randn(5, 32)
    ref = F.rms_norm(qk, (32,), None, 1e-6) * w
    assert torch.allclose(decoder.rms_norm(qk, w, 1e-6, RowOps.C), ref, rtol=1e-5, atol=1e-5)
    assert torch.allclose(decoder.rms_norm(qk, w, 1e-6), ref, rtol=1e-5, atol=1e-5)  # torch's


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_glu_matches_float64_and_rows_are_batch_invariant(act: str) -> None:
    """Held to the function in float64, GELU-tanh written as x * sigmoid(2u): 0.5 x (1 + tanh u)
    cancels for a very negative gate, in torch's fp32 (90% off in relative terms there) and even in
    float64 (0 at x = -7.2, where the value is -2e-16)."""
    x = torch.randn(5, 2 * 1536, generator=torch.Generator().manual_seed(0)) * 4
    x[0, :8] = torch.tensor([-200.0, -90.0, -30.0, 0.0, 1e-8, 30.0, 90.0, 200.0])  # the sigmoid's far ends
    gate, up = x.double().chunk(2, -1)
    z = 2 * math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3) if act == "gelu_tanh" else gate
    ref = gate * torch.sigmoid(z) * up
    assert torch.allclose(F.gelu(gate, approximate="tanh") if act == "gelu_tanh" else F.silu(gate),
                          gate * torch.sigmoid(z), atol=1e-15)  # the same function
    out = cpu_ops.glu(x, act)
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-30)
    assert torch.equal(out[3:4], cpu_ops.glu(x[3:4], act))
    assert torch.equal(decoder.glu(x, act, RowOps.C), out)


def test_a_prompt_chunks_glu_split_over_threads_gives_one_threads_bits() -> None:
    """From 2^16 elements the rows are split over the threads: each row alone, the same bits."""
    x = torch.randn(48, 2 * 1536, generator=torch.Generator().manual_seed(1)) * 4
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_ops.glu(x, "silu")
        torch.set_num_threads(2)
        assert torch.equal(cpu_ops.glu(x, "silu"), one)
        assert torch.equal(cpu_ops.glu(x[:1], "silu"), one[:1])
    finally:
        torch.set_num_threads(saved)


CPU = torch.device("cpu")


def _row_ops(device: torch.device, dtype: torch.dtype, widths: list[int], act: str) -> str:
    return registry.choose("row_ops", RowRequest(device.type, dtype, tuple(widths), act)).name


def test_a_model_takes_the_row_kernels_only_where_they_cover_every_row() -> None:
    assert _row_ops(CPU, torch.float32, [576, 1536, 64], "silu") == "c"
    assert _row_ops(CPU, torch.float32, [640, 2048], "gelu_tanh") == "c"
    assert _row_ops(CPU, torch.bfloat16, [576, 1536], "silu") == "torch"
    assert _row_ops(CPU, torch.float32, [576, 1536], "relu") == "torch"
    assert _row_ops(CPU, torch.float32, [576, 12], "silu") == "torch"  # not a multiple of 8
    assert _row_ops(torch.device("meta"), torch.float32, [576, 1536], "silu") == "torch"


def test_argmax_is_torchs_first_maximum_nan_and_all() -> None:
    x = torch.randn(5, 262_147, generator=torch.Generator().manual_seed(2))  # a tail past the vectors
    x[1, 7] = x[1, 90_000] = 1e9  # ties: the first
    x[2, 262_146] = 1e9  # in the tail
    x[3, 5:9] = float("nan")  # a NaN is the largest, the first one
    x[4] = float("-inf")
    out = cpu_ops.argmax(x)
    assert out.dtype == torch.int64 and torch.equal(out, x.argmax(-1))
    assert out.tolist()[1:4] == [7, 262_146, 5]
    assert torch.equal(cpu_ops.argmax(x[2:3]), x[2:3].argmax(-1))
    assert torch.equal(cpu_ops.argmax(x.bfloat16()), x.bfloat16().argmax(-1))  # torch's, for other dtypes
