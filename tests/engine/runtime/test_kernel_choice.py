"""The output projection's kernel is chosen per row count by measurement, cached per machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from app.engine.runtime import kernel_choice
from app.engine.runtime.kernel_choice import KernelChoice, choose_packed_rows, crossover


def test_crossover_is_the_last_row_count_before_int8_first_loses():
    assert crossover({"1": [15.7, 27.4], "2": [18.3, 25.3], "4": [19.8, 26.2], "8": [34.0, 25.9], "16": [68, 50]}) == 4
    assert crossover({"1": [30.0, 20.0], "2": [40.0, 21.0]}) == 0
    never_lost = {str(r): [1.0, 2.0] for r in (1, 2, 4, 8, 16, 32, 64)}
    assert crossover(never_lost) == 1 << 30
    assert KernelChoice(4).use_packed(4) and not KernelChoice(4).use_packed(5) and not KernelChoice(0).use_packed(1)


class Counted:
    """A kernel whose cost is `per_row` ms-ish of sleeping per row plus `base`."""

    def __init__(self, base: float, per_row: float) -> None:
        self.base, self.per_row, self.calls = base, per_row, 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        import time

        self.calls += 1
        time.sleep((self.base + self.per_row * x.shape[0]) / 1e3)
        return x


def test_choice_is_measured_once_then_read_from_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(kernel_choice.KERNEL_ENV, raising=False)
    cache = tmp_path / "kernel_choice.json"
    int8, dense = Counted(1.0, 1.0), Counted(6.0, 0.0)  # int8 wins up to 4 rows, loses from 8
    choice = choose_packed_rows(int8, dense, (100, 8), torch.float32, cache)
    assert choice.packed_max_rows == 4
    assert int8.calls and dense.calls
    entry = next(iter(json.loads(cache.read_text()).values()))
    assert entry["packed_max_rows"] == 4 and "16" in entry["timings_ms"] and "64" not in entry["timings_ms"]
    again_int8, again_dense = Counted(1.0, 1.0), Counted(6.0, 0.0)
    assert choose_packed_rows(again_int8, again_dense, (100, 8), torch.float32, cache).packed_max_rows == 4
    assert again_int8.calls == again_dense.calls == 0  # the cache answered
    other = choose_packed_rows(Counted(1.0, 1.0), Counted(6.0, 0.0), (200, 8), torch.float32, cache)
    assert other.packed_max_rows == 4 and len(json.loads(cache.read_text())) == 2  # keyed by shape


def test_env_forces_a_kernel_and_a_broken_cache_is_remeasured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    cache = tmp_path / "kernel_choice.json"
    monkeypatch.setenv(kernel_choice.KERNEL_ENV, "dense")
    assert choose_packed_rows(Counted(0, 0), Counted(0, 0), (10, 4), torch.float32, cache).packed_max_rows == 0
    monkeypatch.setenv(kernel_choice.KERNEL_ENV, "packed")
    assert choose_packed_rows(Counted(0, 0), Counted(0, 0), (10, 4), torch.float32, cache).use_packed(10_000)
    assert not cache.exists()
    monkeypatch.delenv(kernel_choice.KERNEL_ENV)
    cache.write_text("{not json")
    assert choose_packed_rows(Counted(0.0, 0.1), Counted(9.0, 0.0), (10, 4), torch.float32, cache).use_packed(64)


def test_linear_uses_the_chosen_kernel_per_row_count(monkeypatch: pytest.MonkeyPatch):
    from app.engine.runtime.linear import Linear
    from app.engine.runtime.weight_forms import Int8Weight

    w = (torch.randn(1000, 64) * 0.05).bfloat16()
    if not Int8Weight.supported(w):
        pytest.skip("torch lacks _weight_int8pack_mm on this build")
    monkeypatch.setenv(kernel_choice.KERNEL_ENV, "packed")
    linear = Linear(w)
    linear.weight, linear.choice = w, KernelChoice(2)  # as a measured crossover at 2 rows keeps it
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(linear(x), torch.nn.functional.linear(x, w))  # 3 rows: above the crossover
    assert torch.equal(linear(x[:2]), linear.packed(x[:2]))
    assert linear.tensors(2)[0] is linear.packed and linear.tensors(3) == [w]
    monkeypatch.setenv(kernel_choice.KERNEL_ENV, "dense")
    assert Linear(w).packed is None  # no int8 copy where it never wins


def test_int8_rows_are_batch_invariant_and_close_to_bf16():
    """Within the int8 kernel each row's output is the same whatever else is in the batch."""
    from app.engine.runtime.weight_forms import Int8Weight

    w = (torch.randn(1000, 64) * 0.05).bfloat16()
    if not Int8Weight.supported(w):
        pytest.skip("torch lacks _weight_int8pack_mm on this build")
    int8 = Int8Weight(w)
    x = torch.randn(11, 64).bfloat16()
    together = int8(x)
    assert torch.equal(together, torch.cat([int8(x[i : i + 1]) for i in range(11)]))
    ref = torch.nn.functional.linear(x, w).float()
    assert ((together.float() - ref).norm() / ref.norm()).item() < 0.02


def test_fp32_compute_runs_fp16_weights_batch_invariant_without_an_fp32_copy(monkeypatch):
    """fp32 compute (a CPU without fast bf16) with the quantized C kernels off keeps fbgemm fp16
    weights instead of fp32 ones: fp32 activations, a row's numbers the same whatever the batch up
    to fp32 summation order (as with the dense fp32 GEMM), within fp32 rounding of the product with
    the fp16-rounded weight."""
    from app.engine.runtime.linear import Linear
    from app.engine.runtime.weight_forms import Fp16Weight
    from app.kernels import cpu_qgemm

    monkeypatch.setenv(cpu_qgemm.ENABLE_ENV, "0")

    w = torch.randn(300, 64) * 0.05
    if not Fp16Weight.supported(w):
        pytest.skip("this torch build has no fbgemm fp16 GEMM")
    bias = torch.randn(300)
    linear = Linear(w, bias, allow_packed=True)
    assert isinstance(linear.dense, Fp16Weight) and linear.weight is None
    x = torch.randn(9, 64)
    together = linear(x)
    assert together.dtype == torch.float32
    assert torch.allclose(together, torch.cat([linear(x[i : i + 1]) for i in range(9)]), atol=1e-6, rtol=1e-6)
    ref = torch.nn.functional.linear(x, w.half().float(), bias)
    assert torch.allclose(together, ref, atol=1e-4, rtol=1e-4)
    assert linear(x[:0]).shape == (0, 300)
    held = [id(t) for t in linear.resident()]
    assert held == [id(linear.dense), id(bias)]  # no fp32 copy
    assert Linear(w, allow_packed=False).weight is w


def test_auto_dtype_on_a_cpu_is_fp32_where_the_c_kernels_build_whatever_bf16_measures(monkeypatch):
    from app.engine.runtime import device
    from app.kernels import cpu_qgemm

    monkeypatch.setattr(device, "cpu_bf16_is_faster", lambda: True)
    monkeypatch.setattr(cpu_qgemm, "enabled", lambda: True)
    assert device.resolve_device("cpu", "auto").dtype == torch.float32
    monkeypatch.setattr(cpu_qgemm, "enabled", lambda: False)  # LOCALBATCH_CPU_QUANT_KERNELS=0, no compiler
    assert device.resolve_device("cpu", "auto").dtype == torch.bfloat16
    assert device.resolve_device("cpu", "bfloat16").dtype == torch.bfloat16


def test_an_x86_cpu_without_bf16_dot_products_computes_in_fp32_whatever_a_probe_says(monkeypatch):
    from app.engine.runtime import device
    from app.kernels import cpu_build

    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    assert device.cpu_bf16_is_faster() is False
