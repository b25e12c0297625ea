"""quants.dequantize: bit-exact with gguf.quants.dequantize for every supported type, and its errors."""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from app.engine.gguf import quants
from app.engine.gguf.quants import SUPPORTED_TYPES, dequantize
from app.engine.gguf.reader import GGUFFile
from app.engine.types.errors import GGUFError

# Byte offsets of the fp16 scale fields inside one block of each block-quantized type.
F16_FIELDS = {
    QT.Q8_0: (0,), QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q5_0: (0,), QT.Q5_1: (0, 2), QT.Q2_K: (80, 82),
    QT.Q3_K: (108,),     QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,), QT.IQ4_NL: (0,), QT.IQ4_XS: (0,),
}
ALL_TYPES = sorted((QT(t) for t in SUPPORTED_TYPES), key=int)


def _sane_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """Finite fp16 values of mixed magnitude, incl. zeros, negative zeros and subnormals."""
    values = rng.standard_normal(n) * 10.0 ** rng.integers(-6, 3, n)
    values[::17] = 0.0
    values[5::17] = -0.0
    values[9::17] = 3e-6  # fp16 subnormal
    return values.astype(np.float16)


def _random_tensor(qtype: QT, n_blocks: int, seed: int = 0) -> np.ndarray:
    """Raw bytes of `n_blocks` blocks: random quants, sane scales (no NaN/inf in fp16 fields)."""
    rng = np.random.default_rng(seed)
    type_size = GGML_QUANT_SIZES[qtype][1]
    if qtype == QT.F32:
        return (rng.standard_normal(n_blocks) * 100).astype(np.float32).view(np.uint8)
    if qtype == QT.F16:
        return _sane_f16(rng, n_blocks).view(np.uint8)
    if qtype == QT.BF16:
        bits = rng.standard_normal(n_blocks).astype(np.float32).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8)
    blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        blocks[:, at:at + 2] = _sane_f16(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(-1)


def _reference(raw: np.ndarray, qtype: QT, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.quants.dequantize(raw, qtype), dtype=np.float32)).reshape(shape)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (stricter than torch.equal: distinguishes -0.0 from 0.0)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _shape(qtype: QT, n_blocks: int) -> tuple[int, ...]:
    block_size = GGML_QUANT_SIZES[qtype][0]
    rows = 3 if n_blocks % 3 == 0 else 1
    return (rows, n_blocks // rows * block_size)


def test_supported_types() -> None:
    names = {QT(t).name for t in SUPPORTED_TYPES}
    assert names == {
        "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
    }
    assert isinstance(SUPPORTED_TYPES, frozenset)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_bit_exact_with_gguf(qtype: QT) -> None:
    n_blocks = 96 if GGML_QUANT_SIZES[qtype][0] > 1 else 3000
    raw = _random_tensor(qtype, n_blocks)
    shape = _shape(qtype, n_blocks)
    out = dequantize(raw, qtype, shape)
    assert out.dtype == torch.float32 and out.is_contiguous()
    assert _bits_equal(out, _reference(raw, qtype, shape))


@pytest.mark.parametrize("n_blocks", [1, 7, 30])
@pytest.mark.parametrize("qtype", [t for t in ALL_TYPES if GGML_QUANT_SIZES[t][0] > 1], ids=lambda t: t.name)
def test_block_counts_and_shapes(qtype: QT, n_blocks: int) -> None:
    # One block, an odd count, and a 3-d shape whose rows hold several blocks.
    block_size = GGML_QUANT_SIZES[qtype][0]
    shape = (n_blocks // 5, 5, block_size) if n_blocks % 5 == 0 else (n_blocks, block_size)
    raw = _random_tensor(qtype, n_blocks, seed=n_blocks)
    assert _bits_equal(dequantize(raw, qtype, shape), _reference(raw, qtype, shape))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_chunk_boundaries(qtype: QT, monkeypatch: pytest.MonkeyPatch) -> None:
    # Force many small, uneven chunks: block count not a multiple of the chunk.
    monkeypatch.setattr(quants, "_CHUNK_ELEMENTS", 3 * GGML_QUANT_SIZES[qtype][0])
    raw = _random_tensor(qtype, 11, seed=5)
    shape = _shape(qtype, 11)
    assert _bits_equal(dequantize(torch.from_numpy(raw.copy()), qtype, shape), _reference(raw, qtype, shape))


def test_real_quantized_values() -> None:
    # Values from gguf's own quantizer (not just random bytes) round-trip identically too.
    data = np.random.default_rng(3).standard_normal((4, 256)).astype(np.float32)
    for qtype in (QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1):
        raw = gguf.quants.quantize(data, qtype).reshape(-1)
        out = dequantize(raw, qtype, (4, 256))
        assert _bits_equal(out, _reference(raw, qtype, (4, 256)))
        assert (out - torch.from_numpy(data)).abs().max() < 0.3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize(
    "qtype", [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_1, QT.Q3_K, QT.Q4_K, QT.Q6_K, QT.IQ4_XS], ids=lambda t: t.name
)
def test_output_dtype(qtype: QT, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quants, "_CHUNK_ELEMENTS", 1024)
    n_blocks = 12 if GGML_QUANT_SIZES[qtype][0] > 1 else 3000
    raw = _random_tensor(qtype, n_blocks, seed=7)
    shape = _shape(qtype, n_blocks)
    out = dequantize(raw, qtype, shape, dtype=dtype)
    assert out.dtype == dtype and torch.equal(out, _reference(raw, qtype, shape).to(dtype))


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.Q8_0], ids=lambda t: t.name)
def test_result_owns_its_memory(qtype: QT) -> None:
    raw = _random_tensor(qtype, 32)
    before = raw.copy()
    source = torch.from_numpy(raw)
    out = dequantize(source, qtype, _shape(qtype, 32))
    out.add_(1.0)  # writable, and must not write through to the source bytes
    assert np.array_equal(raw, before)
    assert out.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()


def test_read_only_and_unaligned_inputs() -> None:
    raw = _random_tensor(QT.F32, 16)
    padded = np.concatenate([np.zeros(1, np.uint8), raw])
    view = padded[1:]
    view.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "not writable" warning is expected to be silenced
        out = dequantize(view, QT.F32, (16,))
    assert _bits_equal(out, _reference(raw, QT.F32, (16,)))
    odd = torch.from_numpy(padded)[1:]
    assert _bits_equal(dequantize(odd, QT.F32, (4, 4)), _reference(raw, QT.F32, (4, 4)))


def test_empty_and_scalar_shapes() -> None:
    assert dequantize(np.zeros(0, np.uint8), QT.Q8_0, (0, 32)).shape == (0, 32)
    assert dequantize(np.zeros(0, np.uint8), QT.F32, (0,)).shape == (0,)
    raw = np.array([1.5], dtype=np.float32).view(np.uint8)
    assert dequantize(raw, QT.F32, ()).item() == 1.5


def test_unsupported_type_names_tensor_and_supported_list() -> None:
    raw = np.zeros(66, np.uint8)
    with pytest.raises(GGUFError) as info:
        dequantize(raw, QT.IQ2_XXS, (256,), name="blk.0.ffn_up.weight")
    message = str(info.value)
    assert message.startswith("tensor 'blk.0.ffn_up.weight': type IQ2_XXS is not supported (supported: F32, F16,")
    assert "Q6_K" in message and "BF16" in message and "IQ4_XS" in message and "\n" not in message
    with pytest.raises(GGUFError, match=r"^tensor type IQ2_XXS is not supported"):
        dequantize(raw, QT.IQ2_XXS, (256,))
    with pytest.raises(GGUFError, match="type <unknown type id 99> is not supported"):
        dequantize(raw, 99, (66,))


@pytest.mark.parametrize(
    "qtype, nbytes, shape, expected",
    [
        (QT.Q8_0, 34, (2, 32), "has 34 bytes, but shape (2, 32) of Q8_0 needs 68"),
        (QT.F32, 12, (4,), "has 12 bytes, but shape (4,) of F32 needs 16"),
        (QT.Q4_K, 144, (16, 16), "shape (16, 16) does not fit Q4_K blocks of 256 elements"),
        (QT.F16, 8, (-2, 2), "shape (-2, 2) has a negative dimension"),
    ],
)
def test_wrong_size(qtype: QT, nbytes: int, shape: tuple[int, ...], expected: str) -> None:
    with pytest.raises(GGUFError) as info:
        dequantize(np.zeros(nbytes, np.uint8), qtype, shape, name="w")
    assert str(info.value) == f"tensor 'w': {expected}"


def test_programming_errors() -> None:
    with pytest.raises(TypeError, match="uint8"):
        dequantize(np.zeros(4, np.float32), QT.F32, (4,))
    with pytest.raises(TypeError, match="uint8"):
        dequantize(torch.zeros(4, dtype=torch.int8), QT.F32, (1,))
    with pytest.raises(ValueError, match="floating-point"):
        dequantize(np.zeros(4, np.uint8), QT.F32, (1,), dtype=torch.int32)


@pytest.mark.slow
def test_embedded_model_full_dequantization(embedded_model_path: Path) -> None:
    with GGUFFile(embedded_model_path) as f:
        start = time.perf_counter()
        total, first_of_type = 0, {}
        for info in f.tensors.values():
            out = dequantize(f.raw(info.name), info.ggml_type, info.shape, name=info.name)
            assert out.shape == info.shape and out.dtype == torch.float32
            total += out.numel()
            if info.ggml_type not in first_of_type and info.n_elements < 2_000_000:
                first_of_type[info.ggml_type] = (info, out)
        elapsed = time.perf_counter() - start
        assert {QT(t).name for t in first_of_type} == {"F32", "Q5_0", "Q4_K", "Q6_K", "Q8_0"}
        for qtype, (info, out) in first_of_type.items():
            assert _bits_equal(out, _reference(f.raw(info.name), QT(qtype), info.shape)), info.name
        # The embedding against gguf on its first rows (all of it is ~4 s in numpy).
        embd = f.tensors["token_embd.weight"]
        rows = 256
        head = f.raw(embd.name)[: rows * 640 // 32 * 34]
        assert _bits_equal(dequantize(head, embd.ggml_type, (rows, 640)), _reference(head, QT.Q8_0, (rows, 640)))
    assert total > 268_000_000
    # ~0.5 s on an idle 2-core machine. The bound only catches a fall-back to per-block loops: with
    # OpenMP spin-waiting, 2 threads on a machine shared with other jobs can take 10-20 s.
    assert elapsed < 60, f"dequantizing the embedded model took {elapsed:.2f} s"


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_grid_form_gives_the_dequantized_values(qtype):
    """levels * step + low per group of 32 equals dequantize() exactly, read from the blocks."""
    from gguf import GGMLQuantizationType
    from gguf import quants as gq

    from app.engine.gguf.quants import GridForm, dequantize, grid_form

    t = GGMLQuantizationType[qtype]
    w = (torch.randn(24, 256, generator=torch.Generator().manual_seed(3)) * 0.05).numpy()
    raw = gq.quantize(w, t)
    form = grid_form(raw, t, (24, 256))
    assert form.bits == (4 if qtype.startswith("Q4") else 5) and int(form.levels.max()) < (1 << form.bits)
    values = form.levels.float().view(24, 8, 32) * form.step.unsqueeze(-1) + form.low.unsqueeze(-1)
    assert torch.equal(values.view(24, 256), dequantize(raw, t, (24, 256)))
    both = GridForm.cat([form, form])
    assert both.levels.shape == (48, 256) and both.step.shape == (48, 8)
    assert grid_form(gq.quantize(w, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0, (24, 256)) is None
    assert GridForm.cat([form, None]) is None


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_packed_levels_read_from_the_blocks_are_the_grids_levels(qtype):
    """nibble_form / q6_parts regroup the blocks' bits without a byte a level: unpacked again they are
    grid_form's levels, steps and lows exactly."""
    from gguf import GGMLQuantizationType

    from app.engine.gguf.quants import BlockTensor, NibbleForm, Q6Parts

    t = GGMLQuantizationType[qtype]
    rng = np.random.default_rng(4)
    block, size = GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, (24 * 512 // block, size), dtype=np.uint8)
    start, count = {"Q4_0": (0, 1), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208, 1)}[qtype]  # fp16 d (and m)
    raw[:, start:start + 2 * count] = np.float16(rng.uniform(1e-4, 1e-3, (len(raw), count))).view(np.uint8)
    matrix = BlockTensor(torch.from_numpy(raw.reshape(-1)), int(t), (24, 512))
    grid, packed = matrix.grid(), matrix.nibbles()
    halves = packed.nibbles.view(24, -1, 16)
    levels = torch.cat((halves & 0x0F, halves >> 4), -1).view(24, 512)
    if qtype == "Q6_K":
        assert isinstance(packed, Q6Parts)
        assert torch.equal(levels | (packed.top << 4), grid.levels)
        assert torch.equal(packed.scales, grid.scales) and torch.equal(packed.d, grid.d)
    else:
        assert isinstance(packed, NibbleForm)
        assert torch.equal(levels, grid.levels)
        assert torch.equal(packed.step, grid.step) and torch.equal(packed.low, grid.low)
    assert BlockTensor(torch.from_numpy(raw.reshape(-1)), int(t), (24, 512)).grid_bits == grid.bits
