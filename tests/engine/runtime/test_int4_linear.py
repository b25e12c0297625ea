"""4-bit GGUF matrices run through torch's int4 CPU kernel; finer ones keep int8."""

from __future__ import annotations

import pytest
import torch

from app.engine.runtime import kernel_choice
from app.engine.runtime.linear import Linear
from app.engine.runtime.weight_forms import Int4Weight, Int8Weight

pytestmark = pytest.mark.skipif(
    not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"), reason="torch lacks the int4 CPU kernel"
)


def _grid_weight(bits: int, rows: int = 96, cols: int = 128, seed: int = 0) -> torch.Tensor:
    """A dequantized Q4_1-like bf16 matrix (step * level + min per 32 weights, both ends used), or a
    finer one with `bits` > 4."""
    g = torch.Generator().manual_seed(seed)
    top = 2**bits - 1
    step = torch.rand(rows, cols // 32, 1, generator=g) * 0.02 + 0.001
    low = -(top + 1) / 2 * step * (1 + 0.2 * torch.rand(rows, cols // 32, 1, generator=g))
    levels = torch.randint(0, top + 1, (rows, cols // 32, 32), generator=g).float()
    levels[..., 0], levels[..., 1] = 0, top
    return (levels * step + low).view(rows, cols).bfloat16()


def test_a_4bit_matrix_packs_as_int4_closer_to_bf16_than_int8():
    w = _grid_weight(4)
    int4 = Int4Weight.from_grid(w)
    assert int4 is not None
    x = torch.randn(5, w.shape[1]).bfloat16()
    ref = torch.nn.functional.linear(x, w).float()

    def err(y: torch.Tensor) -> float:
        return ((y.float() - ref).norm() / ref.norm()).item()

    assert err(int4(x)) < 0.01
    assert err(int4(x)) < err(Int8Weight(w)(x))  # no new rounding: the levels are the file's own
    together = int4(x)
    assert torch.equal(together, torch.cat([int4(x[i : i + 1]) for i in range(5)]))  # batch invariant


def test_finer_or_unquantized_matrices_are_not_packed_as_int4():
    assert Int4Weight.from_grid(_grid_weight(5)) is None  # Q5_0-like: 32 levels per group
    assert Int4Weight.from_grid(torch.randn(96, 128).bfloat16()) is None
    assert Int4Weight.from_grid(_grid_weight(4)[:, :112]) is None  # not whole groups of 32


def test_linear_takes_int4_for_a_4bit_matrix_and_int8_otherwise(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(kernel_choice.KERNEL_ENV, "packed")  # packed at every row count: no measuring
    w = _grid_weight(4)
    linear = Linear(w)
    assert isinstance(linear.packed, Int4Weight)
    x = torch.randn(3, w.shape[1]).bfloat16()
    assert torch.equal(linear(x), linear.packed(x))
    assert linear.tensors(3)[0] is linear.packed
    assert isinstance(Linear(torch.randn(96, 128).bfloat16()).packed, Int8Weight)


def test_int4_choices_are_cached_apart_from_int8(tmp_path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(kernel_choice.KERNEL_ENV, raising=False)
    cache = tmp_path / "choice.json"
    fast, slow = (lambda x: x), (lambda x: x + 0)
    kernel_choice.choose_packed_rows(fast, slow, (16, 32), torch.bfloat16, cache, kind="int4")
    kernel_choice.choose_packed_rows(fast, slow, (16, 32), torch.bfloat16, cache)
    keys = list(__import__("json").loads(cache.read_text()))
    assert len(keys) == 2 and sum(k.endswith("|int4") for k in keys) == 1


def test_a_requantized_matrix_is_within_half_a_level_of_its_source(monkeypatch: pytest.MonkeyPatch):
    """The large-vocabulary head's int4 copy: any bf16 matrix rounded to 16 levels per group."""
    monkeypatch.setenv(kernel_choice.KERNEL_ENV, "packed")
    w = (torch.randn(96, 128) * 0.05).bfloat16()
    int4 = Int4Weight.requantized(w)
    assert int4 is not None and Int4Weight.from_grid(w) is None
    eye = torch.eye(128).bfloat16()
    rebuilt = int4(eye).float().T  # column j of x @ W.T for x = I is row j of W
    groups = w.float().view(96, 4, 32)
    half_step = ((groups.amax(-1) - groups.amin(-1)) / 30).repeat_interleave(32, -1)
    assert bool(((rebuilt - w.float()).abs() <= half_step * 1.05 + 1e-3).all())
    assert isinstance(Linear(w, requantize_int4=True).packed, Int4Weight)
    assert isinstance(Linear(w).packed, Int8Weight)
    assert Int4Weight.requantized(w[:, :112]) is None  # not whole groups of 32
