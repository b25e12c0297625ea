"""Each matrix takes its form once (`weight_forms.choose_forms`), and the C kernels' forms built
straight from a file's blocks (`BlockTensor`) hold the same bytes as the ones built from the fp32
tensor the loader used to dequantize first."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from app.engine.gguf.loader import load_gguf
from app.engine.gguf.quants import BlockTensor, GridForm, dequantize, grid_form
from app.engine.gguf.reader import GGUFFile
from app.engine.runtime import kernel_choice
from app.engine.runtime.decoder import DecoderLM
from app.engine.runtime.linear import Linear
from app.engine.runtime.weight_forms import (
    FusedMatrix,
    TensorMatrix,
    choose_forms,
    fused,
    grid_packed,
    takes_groups,
)
from app.kernels import cpu_qgemm
from app.kernels.cpu_qgemm import Q4KWeight, Q4Weight, Q5Weight, Q6Weight, Q8Weight, SplitWeight

pytestmark = pytest.mark.skipif(
    cpu_qgemm._library() is None, reason="no C compiler or no AVX2/FMA/F16C here: the C kernels cannot build"
)

_T = gguf.GGMLQuantizationType
MODEL_05B = Path("/root/.local/share/localbatch/models/qwen2.5-coder-0.5b-instruct.gguf")


def _blocks(qtype: _T, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random blocks of `qtype` with small finite fp16 scales (K-quants: gguf-py cannot quantize)."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype in (_T.F32, _T.F16):
        return (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32 if qtype == _T.F32 else np.float16).view(np.uint8)
    if qtype in (_T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0):
        return gguf.quants.quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), qtype)
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    scales = {_T.Q4_K: (0, 4), _T.Q5_K: (0, 4), _T.Q6_K: (208, 210), _T.Q2_K: (80, 84), _T.Q3_K: (108, 110),
              _T.IQ4_NL: (0, 2)}[qtype]
    n = (scales[1] - scales[0]) // 2
    raw[:, scales[0]:scales[1]] = np.float16(rng.uniform(1e-4, 1e-3, (len(raw), n))).view(np.uint8)
    return raw.reshape(rows, -1)


def _old_form(raw: torch.Tensor, qtype: int, shape: tuple[int, int]):
    """The C kernels' copy as it was made: the whole matrix dequantized to fp32, its grid read
    from the blocks, 8-bit groups from the fp32 values where there is none."""
    form = grid_form(raw, qtype, shape)
    return grid_packed(form) if form is not None else Q8Weight(dequantize(raw, qtype, shape))


def _same(a, b) -> None:
    assert type(a) is type(b)
    assert (a.out_features, a.in_features) == (b.out_features, b.in_features)
    for name in a._TENSORS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K",
                                   "Q2_K", "Q3_K", "IQ4_NL"])
def test_each_type_built_from_its_blocks_holds_the_same_bytes(qtype):
    t = _T[qtype]
    rows, cols = 40, 512  # 40: a last tile of 8 rows and, for the fused one, parts that split tiles
    raw = torch.from_numpy(_blocks(t, rows, cols, seed=1).reshape(-1))
    blocks = BlockTensor(raw, int(t), (rows, cols))
    new = choose_forms(blocks).packed
    _same(new, _old_form(raw, int(t), (rows, cols)))
    want = Q4KWeight if qtype == "Q4_K" else {4: Q4Weight, 5: Q5Weight, 6: Q6Weight, None: Q8Weight}[blocks.grid_bits]
    assert type(new) is want
    assert torch.equal(blocks.rows(3, 17), blocks.dense()[3:17])


def test_fused_blocks_keep_a_common_grid_or_split_into_runs(monkeypatch):
    """q/k/v or gate/up stacked: one grid where every part has one of a kind (4 and 5 bits: 5);
    else each run of parts of one grid size in its own form (8-bit groups read part by part where
    a run has none), one call giving their outputs side by side."""
    monkeypatch.setattr(cpu_qgemm, "CHUNK_ROWS", 16)  # chunks that cross the parts' boundaries
    shapes = [(24, 256), (12, 256), (12, 256)]
    cases = {  # types -> the runs' forms, None: one common grid
        (_T.Q4_K, _T.Q4_K, _T.Q6_K): [Q4KWeight, Q6Weight], (_T.Q5_0, _T.Q5_0, _T.Q8_0): [Q5Weight, Q8Weight],
        (_T.Q4_0, _T.Q5_1, _T.Q4_K): None, (_T.Q6_K, _T.Q6_K, _T.Q6_K): None, (_T.F16, _T.Q4_0, _T.Q4_0): [Q8Weight, Q4Weight],
    }
    x = torch.randn(5, 256)
    for types, runs in cases.items():
        raws = [torch.from_numpy(_blocks(t, r, c, seed=i).reshape(-1)) for i, (t, (r, c)) in enumerate(zip(types, shapes))]
        parts = [BlockTensor(raw, int(t), s) for raw, t, s in zip(raws, types, shapes)]
        matrix = fused(parts)
        assert isinstance(matrix, FusedMatrix)
        dense = torch.cat([dequantize(raw, int(t), s) for raw, t, s in zip(raws, types, shapes)])
        packed = choose_forms(matrix).packed
        assert torch.equal(matrix.rows(5, 40), dense[5:40])
        if runs is None:
            _same(packed, grid_packed(GridForm.cat([grid_form(raw, int(t), s) for raw, t, s in zip(raws, types, shapes)])))
            continue
        assert isinstance(packed, SplitWeight) and [type(p) for p in packed.parts] == runs
        first = 1 if types[0] != types[1] else 2  # the first run's parts
        for part, run in zip(packed.parts, (parts[:first], parts[first:])):
            _same(part, choose_forms(fused(run)).packed)
        assert torch.equal(packed(x), torch.cat([p(x) for p in packed.parts], 1))
        if Q8Weight not in runs:  # the file's own numbers: dequantized exactly
            assert torch.equal(packed.dequantize_ref(), dense)


def test_a_tensor_source_fits_its_grid_as_before():
    """Random weights (no file) still look for a 4/5-bit grid in the values; a tensor the loader
    said has none (`fit_grid=False`) takes 8 bits."""
    raw = torch.from_numpy(_blocks(_T.Q4_1, 16, 256, seed=3).reshape(-1))
    weight = dequantize(raw, int(_T.Q4_1), (16, 256))
    assert isinstance(choose_forms(TensorMatrix(weight)).packed, Q4Weight)
    assert type(choose_forms(TensorMatrix(weight, fit_grid=False)).packed) is Q8Weight
    assert type(Linear(weight, fit_grid=False).packed) is Q8Weight


def test_the_forms_are_chosen_once_by_device_and_dtype(monkeypatch):
    monkeypatch.setenv(kernel_choice.KERNEL_ENV, "packed")  # no measuring
    w = torch.randn(64, 96) * 0.05
    assert takes_groups(torch.device("cpu"), torch.float32)
    assert not takes_groups(torch.device("cpu"), torch.bfloat16)
    assert isinstance(choose_forms(TensorMatrix(w)).packed, Q8Weight)
    assert choose_forms(TensorMatrix(w[:, :90])).packed is None  # not whole groups: fbgemm fp16 or dense
    monkeypatch.setenv(kernel_choice.KERNEL_ENV, "dense")
    forms = choose_forms(TensorMatrix(w))
    assert forms.weight is w and forms.packed is None and forms.dense is None


def _packed_of(model: DecoderLM) -> list:
    return [lin.packed for layer in model.layers for lin in layer.linears()] + [model.head.packed]


@pytest.mark.parametrize("weight_type", ["F32", "F16", "Q8_0"])
@pytest.mark.parametrize("tied", [True, False])
def test_a_model_from_blocks_equals_one_from_fp32_tensors(weight_type, tied, tiny_gguf_factory):
    path = tiny_gguf_factory("qwen2", weight_type=weight_type, tie_word_embeddings=tied)
    cpu = torch.device("cpu")
    loaded = load_gguf(path, cpu, torch.float32, grids=True)
    assert all(isinstance(w, BlockTensor) for n, w in loaded.weights.items() if n.endswith("weight") and "norm" not in n)
    new = DecoderLM(loaded.config, loaded.weights, cpu, loaded.grids)
    old_weights = load_gguf(path, cpu, torch.float32).weights
    with GGUFFile(path) as f:
        grids = {n: g for n, info in f.tensors.items() if (g := grid_form(f.raw(n), info.ggml_type, info.shape))}
    old = DecoderLM(loaded.config, old_weights, cpu, grids)
    for a, b in zip(_packed_of(new), _packed_of(old), strict=True):
        _same(a, b)
    assert (new.embed_rows is None) == (old.embed_rows is None)
    if new.embed_rows is not None:
        _same(new.embed_rows, old.embed_rows)
        assert (new.embed_rows is new.head.packed) == tied
    else:
        assert new.embed.dtype == old.embed.dtype and torch.equal(new.embed, old.embed)
    assert new.resident_weight_bytes() == old.resident_weight_bytes()


@pytest.mark.skipif(not MODEL_05B.exists(), reason="the Qwen2.5-Coder 0.5B GGUF is not pulled here")
def test_real_layers_of_the_0_5b_model_hold_the_same_bytes():
    """Layers with each of the file's mixes (q/k Q5_0 with a Q5_0 or Q8_0 v: split in two; a Q4_K
    or Q6_K down)."""
    with GGUFFile(MODEL_05B) as f:
        def v_type(i: int) -> int:
            return f.tensors[f"blk.{i}.attn_v.weight"].ggml_type

        def down_type(i: int) -> int:
            return f.tensors[f"blk.{i}.ffn_down.weight"].ggml_type

        layers = {next(i for i in range(24) if v_type(i) == _T.Q8_0), next(i for i in range(24) if v_type(i) == _T.Q5_0),
                  next(i for i in range(24) if down_type(i) == _T.Q6_K), next(i for i in range(24) if down_type(i) == _T.Q4_K)}
        for i in sorted(layers):
            for names in (["attn_q", "attn_k", "attn_v"], ["attn_output"], ["ffn_gate", "ffn_up"], ["ffn_down"]):
                names = [f"blk.{i}.{n}.weight" for n in names]
                infos = [f.tensors[n] for n in names]
                parts = [BlockTensor(f.raw(n), info.ggml_type, info.shape, name=n) for n, info in zip(names, infos)]
                new = choose_forms(fused(parts)).packed
                grids = [grid_form(f.raw(n), info.ggml_type, info.shape) for n, info in zip(names, infos)]
                dense = torch.cat([dequantize(f.raw(n), info.ggml_type, info.shape) for n, info in zip(names, infos)])
                common = GridForm.cat(grids)
                if common is not None:
                    _same(new, grid_packed(common))
                    continue
                # q/k Q5_0 beside a Q8_0 v: each run of one grid size as the old path made it alone
                assert isinstance(new, SplitWeight) and len(new.parts) == 2
                rows = infos[0].shape[0] + infos[1].shape[0]
                _same(new.parts[0], grid_packed(GridForm.cat(grids[:2])))
                _same(new.parts[1], Q8Weight(dense[rows:]))
