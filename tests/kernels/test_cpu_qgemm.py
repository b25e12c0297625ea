"""The C kernels for 4/5/8-bit weight groups (app/kernels/cpu_qgemm.c) against their torch
references: quantized activations times the dequantized weights."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from app.engine.gguf.quants import dequantize
from app.engine.runtime import kernel_choice
from app.engine.runtime.linear import Linear
from app.engine.runtime.weight_forms import grid_weight, group_weight
from app.kernels import cpu_build, cpu_qgemm
from app.kernels.cpu_qgemm import Q4KWeight, Q4Weight, Q5Weight, Q6Weight, Q8Weight, SplitWeight, fake_quantize

pytestmark = pytest.mark.skipif(
    cpu_qgemm._library() is None, reason="no C compiler or no AVX2/FMA/F16C here: the C kernels cannot build"
)


def _q4(n: int = 96, k: int = 128, seed: int = 0) -> Q4Weight:
    g = torch.Generator().manual_seed(seed)
    d = torch.rand(n, k // 32, generator=g) * 0.02 + 0.001
    m = -torch.rand(n, k // 32, generator=g) * 0.1
    levels = torch.randint(0, 16, (n, k // 32, 32), generator=g)
    levels[..., 0], levels[..., 1] = 0, 15  # every group spans its grid, as a Q4 block's min and max
    return Q4Weight(levels.view(n, k), d, m)


def _q5(n: int = 96, k: int = 128, seed: int = 0) -> Q5Weight:
    g = torch.Generator().manual_seed(seed)
    d = torch.rand(n, k // 32, generator=g) * 0.02 + 0.001
    m = -torch.rand(n, k // 32, generator=g) * 0.2
    levels = torch.randint(0, 32, (n, k // 32, 32), generator=g)
    levels[..., 0], levels[..., 1] = 0, 31
    return Q5Weight(levels.view(n, k), d, m)


def _q4_0(n: int = 96, k: int = 128, seed: int = 0) -> Q4Weight:
    """m = -8 d in every group (a Q4_0 tensor): m is made in the kernel, not stored."""
    g = torch.Generator().manual_seed(seed)
    d = torch.rand(n, k // 32, generator=g) * 1e-3
    w = Q4Weight(torch.randint(0, 16, (n, k), generator=g), d, -8 * d.half().float())
    assert w.name == "q4_0" and w.m is None
    return w


def _q5_0(n: int = 96, k: int = 128, seed: int = 0) -> Q5Weight:
    g = torch.Generator().manual_seed(seed)
    d = torch.rand(n, k // 32, generator=g) * 1e-3
    w = Q5Weight(torch.randint(0, 32, (n, k), generator=g), d, -16 * d.half().float())
    assert w.name == "q5_0" and w.m is None and w.nbytes * 8 == 5.5 * k * -(-n // 8) * 8  # 5.5 bits, padded tiles
    return w


def _q4k(n: int = 96, k: int = 128, seed: int = 0) -> Q4KWeight:
    """Q4_K rows are whole blocks of 256: k's groups become as many blocks (96: an odd number)."""
    g = torch.Generator().manual_seed(seed)
    k = k // 32 * 256
    levels = torch.randint(0, 16, (n, k), generator=g)
    levels[:, 0], levels[:, 1] = 0, 15
    d, dmin = (torch.rand(n, k // 256, generator=g).half().float() * 1e-3 for _ in range(2))
    scales, mins = (torch.randint(0, 64, (n, k // 32), generator=g).to(torch.uint8) for _ in range(2))
    return Q4KWeight(levels, d, dmin, scales, mins)


def _q6(n: int = 96, k: int = 128, seed: int = 0) -> Q6Weight:
    """Q6_K rows are whole blocks of 256: k's groups become as many blocks (96: an odd number)."""
    g = torch.Generator().manual_seed(seed)
    k = k // 32 * 256
    levels = torch.randint(0, 64, (n, k), generator=g).to(torch.uint8)
    levels[:, 0], levels[:, 1] = 0, 63
    scales = torch.randint(-128, 128, (n, k // 16), generator=g).to(torch.int8)
    d = torch.rand(n, k // 256, generator=g) * 1e-3 + 1e-4
    return Q6Weight(levels, scales, d.repeat_interleave(8, -1))


def test_q6_holds_one_d_a_block_and_refuses_what_is_not_q6_k():
    w = _q6(24, 96)
    assert w.d.shape == (3, 3, 8)  # [tiles, blocks, rows]: one fp16 per 256 weights, as the file
    assert w.nbytes * 8 / (24 * 768) == 6.5625
    levels, scales = torch.zeros(8, 256, dtype=torch.uint8), torch.ones(8, 16, dtype=torch.int8)
    with pytest.raises(ValueError, match="differs within a block"):
        Q6Weight(levels, scales, torch.arange(8.0).repeat(8, 1))
    with pytest.raises(ValueError, match="whole blocks of 256"):
        Q6Weight(levels[:, :128], scales[:, :8], torch.ones(8, 4))


def _q8(n: int = 96, k: int = 128, seed: int = 0) -> Q8Weight:
    return Q8Weight(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05)


@pytest.mark.parametrize("k", [128, 96])  # 96: an odd number of groups
@pytest.mark.parametrize("make", [_q4, _q4_0, _q4k, _q5, _q5_0, _q6, _q8],
                         ids=["q4", "q4_0", "q4k", "q5", "q5_0", "q6", "q8"])
def test_kernel_matches_quantized_activations_times_dequantized_weights(make, k):
    w = make(k=k)
    x = torch.randn(19, w.in_features) * 3
    ref = (fake_quantize(x).double() @ w.dequantize_ref().double().T).float()
    scale = ref.abs().max()
    assert (w(x) - ref).abs().max() <= 1e-6 * scale
    exact = x @ w.dequantize_ref().T
    assert (w(x) - exact).norm() / exact.norm() < 0.02  # 8-bit activations per group of 32


@pytest.mark.parametrize(("n", "k"), [(96, 128), (100, 96)])
@pytest.mark.parametrize("make", [_q4, _q4_0, _q4k, _q5, _q5_0, _q6, _q8],
                         ids=["q4", "q4_0", "q4k", "q5", "q5_0", "q6", "q8"])
def test_rows_are_batch_invariant_and_empty_batches_work(make, n, k):
    """13 rows are a block of 8 and one of 5 (the split kernels); a single row, 5 rows and 6 rows in
    all take the fused and the few-row kernels (100 weight rows: a last tile of 4): the same bits."""
    w = make(n, k)
    x = torch.randn(13, w.in_features)
    together = w(x)
    assert torch.equal(together, torch.cat([w(x[i : i + 1]) for i in range(13)]))
    assert torch.equal(together[3:9], w(x[3:9]))
    assert torch.equal(together[2:7], w(x[2:7]))
    assert w(x[:0]).shape == (0, w.out_features)


def test_zero_groups_and_the_q8_rows_of_a_tied_embedding():
    w = _q8()
    x = torch.randn(4, w.in_features)
    x[:, :32] = 0.0  # an all-zero group quantizes to scale 0, not NaN
    assert torch.isfinite(w(x)).all()
    ids = torch.tensor([5, 0, 95, 5])
    assert torch.equal(w.rows(ids), w.dequantize_ref()[ids])
    q4 = _q4()  # a tied Q4 table: its rows from the 4-bit groups
    assert torch.equal(q4.rows(ids), q4.dequantize_ref()[ids])


@pytest.mark.parametrize("k", [128, 96])
def test_the_tiled_layouts_keep_every_weight(k):
    """The kernels' interleaved tiles give back the rows they were made of."""
    g = torch.Generator().manual_seed(1)
    levels = torch.randint(0, 16, (21, k), generator=g)
    d, m = torch.rand(21, k // 32, generator=g).half(), -torch.rand(21, k // 32, generator=g).half()
    q4 = Q4Weight(levels, d, m)
    assert torch.equal(q4.levels().view(21, k), levels.to(torch.uint8))
    expected = levels.float().view(21, -1, 32) * d.float().unsqueeze(-1) + m.float().unsqueeze(-1)
    assert torch.equal(q4.dequantize_ref(), expected.view(21, k))
    levels5 = torch.randint(0, 32, (21, k), generator=g)
    q5 = Q5Weight(levels5, d, m)
    assert torch.equal(q5.levels().view(21, k), levels5.to(torch.uint8))
    ids = torch.tensor([20, 3, 8, 3])
    assert torch.equal(q5.rows(ids), q5.dequantize_ref()[ids])
    w = torch.randn(21, k, generator=g)
    q8 = Q8Weight(w)
    assert (q8.dequantize_ref() - w).abs().max() <= w.abs().max() / 127


@pytest.mark.parametrize(("kind", "packed"), [("Q4_0", Q4Weight), ("Q4_1", Q4Weight), ("Q5_0", Q5Weight),
                                              ("Q5_1", Q5Weight), ("Q8_0", Q8Weight)])
def test_a_gguf_tensor_keeps_its_own_grid(kind, packed):
    """A dequantized Q4/Q5 tensor gets the 4/5-bit groups with its own numbers (no new rounding);
    Q8_0 stays 8-bit."""
    x = np.random.default_rng(0).standard_normal((48, 256)).astype(np.float32) * 0.05
    ggml_type = gguf.GGMLQuantizationType[kind]
    raw = gguf.quants.quantize(x, ggml_type)
    weight = dequantize(torch.from_numpy(raw.view(np.uint8).reshape(-1)), int(ggml_type), (48, 256))
    w = group_weight(weight)
    assert type(w) is packed
    assert torch.equal(w.dequantize_ref(), weight)


def test_a_q6_k_tensor_keeps_its_own_bits():
    """Q6_K: levels, int8 scales per 16 and d read straight from the blocks; the C kernels' copy
    dequantizes to exactly gguf's numbers, takes 7 bits a weight, and a fused q/k/v with a Q6_K v
    beside Q4_K q and k has no common form (8-bit groups)."""
    from app.engine.gguf.quants import GridForm, Q6Form, grid_form
    from app.engine.runtime.linear import Linear

    rng = np.random.default_rng(2)
    blocks = rng.integers(0, 256, (48, 210), dtype=np.uint8)
    blocks[:, 208:210] = np.float16(rng.uniform(1e-4, 1e-3, (48, 1))).view(np.uint8)
    raw = torch.from_numpy(blocks.reshape(-1))
    q6 = int(gguf.GGMLQuantizationType.Q6_K)
    weight = dequantize(raw, q6, (48, 256))
    ref = torch.from_numpy(gguf.quants.dequantize(blocks.reshape(-1), gguf.GGMLQuantizationType.Q6_K).reshape(48, 256))
    assert torch.equal(weight, ref)
    form = grid_form(raw, q6, (48, 256))
    assert isinstance(form, Q6Form)
    lin = Linear(weight, grid=form)
    assert isinstance(lin.packed, Q6Weight) and lin.weight is None
    assert torch.equal(lin.packed.dequantize_ref(), weight)
    assert lin.packed.nbytes * 8 / weight.numel() == 6.5625  # as the file: d once per 256
    x = torch.randn(5, 256)
    want = (fake_quantize(x).double() @ weight.double().T).float()
    assert (lin(x) - want).abs().max() <= 1e-6 * want.abs().max()
    q4 = GridForm(torch.zeros(48, 256, dtype=torch.uint8), torch.ones(48, 8), torch.zeros(48, 8), 4)
    assert GridForm.cat([q4, form]) is None
    assert isinstance(GridForm.cat([form, form]), Q6Form)


def test_a_k_quant_sub_block_need_not_reach_either_end_of_its_grid():
    """Q4_K: w = d * scale * q - dmin * min per sub-block of 32, levels 0..15 that a sub-block need
    not span. Its 4-bit groups take the step from the smallest gap; the fp16 step and low are
    within 2^-11 of the products, far inside an 8-bit requantization's half level."""
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (48, 144), dtype=np.uint8)
    blocks[:, 0:4] = np.float16(rng.uniform(1e-4, 1e-3, (48, 2))).view(np.uint8)  # d, dmin
    blocks[:, 16:] &= 0x77  # levels 0..7: no sub-block spans 0..15
    weight = dequantize(torch.from_numpy(blocks.reshape(-1)), int(gguf.GGMLQuantizationType.Q4_K), (48, 256))
    w = group_weight(weight)
    assert isinstance(w, Q4Weight) and not isinstance(w, Q5Weight)
    span = (weight.view(48, -1, 32).amax(-1) - weight.view(48, -1, 32).amin(-1)).amax()
    assert (w.dequantize_ref() - weight).abs().max() <= span / 2048


def test_linear_takes_the_c_kernels_unless_turned_off(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(kernel_choice.KERNEL_ENV, "packed")  # no measuring
    four_bit = _q4().dequantize_ref()
    monkeypatch.setenv(cpu_qgemm.ENABLE_ENV, "0")
    assert not isinstance(Linear(four_bit).packed, (Q4Weight, Q8Weight))  # turned off: fbgemm fp16
    monkeypatch.delenv(cpu_qgemm.ENABLE_ENV)
    linear = Linear(four_bit)
    assert isinstance(linear.packed, Q4Weight) and linear.weight is None and linear.dense is None
    assert torch.equal(linear.packed.dequantize_ref(), four_bit)  # the file's own 4-bit grid: no new rounding
    assert isinstance(Linear(torch.randn(64, 96)).packed, Q8Weight)  # finer than 4 bits
    assert [id(t) for t in linear.resident()] == [id(linear.packed)]  # the only copy
    assert grid_weight(torch.randn(64, 96), 4) is None and grid_weight(torch.randn(64, 96), 5) is None


_VNNI = "AVX-512 VNNI"


@pytest.fixture
def each_isa():
    """Runs a test's kernels with the AVX2 tiles, then the AVX-512 VNNI ones where this CPU has them
    (skipped with the reason elsewhere); the machine's own choice is restored after."""
    chosen = cpu_qgemm.isa()
    yield lambda name: cpu_qgemm.set_isa(name) or pytest.skip(f"this CPU lacks {name} (cpuid or the OS's registers)")
    cpu_qgemm.set_isa(chosen)


@pytest.mark.parametrize("isa", ["AVX2", _VNNI])
@pytest.mark.parametrize("make", [_q4, _q4_0, _q4k, _q5, _q5_0, _q6, _q8],
                         ids=["q4", "q4_0", "q4k", "q5", "q5_0", "q6", "q8"])
def test_each_instruction_set_gives_the_reference_and_the_same_bits(make, isa, each_isa):
    """Every row count a tile or a VNNI pair sees (1..8, blocks of 8 and a rest) against the torch reference; the
    VNNI tiles' integer dots are exact too, so their outputs equal AVX2's bit for bit."""
    w = make(100, 96)
    x = torch.randn(21, w.in_features) * 2
    cpu_qgemm.set_isa("AVX2")
    avx2 = [w(x[:rows]) for rows in (1, 2, 3, 4, 5, 6, 7, 8, 13, 21)]
    each_isa(isa)
    assert cpu_qgemm.isa() == isa
    ref = (fake_quantize(x).double() @ w.dequantize_ref().double().T).float()
    for got in [w(x[:rows]) for rows in (1, 2, 3, 4, 5, 6, 7, 8, 13, 21)]:
        assert (got - ref[: len(got)]).abs().max() <= 1e-6 * ref.abs().max()
    for rows, (got, want) in enumerate(zip([w(x[:rows]) for rows in (1, 2, 3, 4, 5, 6, 7, 8, 13, 21)], avx2)):
        assert torch.equal(got, want), rows


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("make", [_q4, _q4_0, _q4k, _q5, _q5_0, _q6, _q8],
                         ids=["q4", "q4_0", "q4k", "q5", "q5_0", "q6", "q8"])
def test_the_vnni_prefill_pairs_give_the_avx2_bits(make, threads, each_isa):
    """Prefill on AVX-512 VNNI takes two tiles at once against blocks of 16 and 8 rows (40 rows:
    both, and a rest); 116 rows of weights: a pair that ends in a cut tile (with 2 threads)."""
    w = make(116, 96)
    x = torch.randn(40, w.in_features) * 2
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu_qgemm.set_isa("AVX2")
        avx2 = [w(x[:rows]) for rows in (8, 17, 40)]
        each_isa(_VNNI)
        ref = (fake_quantize(x).double() @ w.dequantize_ref().double().T).float()
        for rows, want in zip((8, 17, 40), avx2):
            got = w(x[:rows])
            assert torch.equal(got, want), rows
            assert (got - ref[:rows]).abs().max() <= 1e-6 * ref.abs().max()
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("make", [_q4k, _q5_0, _q6, _q8], ids=["q4k", "q5_0", "q6", "q8"])
def test_the_vnni_panels_give_the_avx2_bits_across_blocks(make, each_isa):
    """From 32 rows the VNNI pairs go through panels: K = 8,960 (the 1.5B's down) makes blocks of
    112 rows (280 groups), so 117 rows are a full block and one of 5
    (a pass of 4 and a rest); 116 weight rows: two pairs at once, one pair, then a lone tile."""
    w = make(116, 1120) if make in (_q4k, _q6) else make(116, 8960)
    assert w.in_features == 8960
    x = torch.randn(117, 8960)
    cpu_qgemm.set_isa("AVX2")
    want = w(x)
    each_isa(_VNNI)
    got = w(x)
    assert torch.equal(got, want)
    assert torch.equal(w(x[:33]), want[:33])


def test_rows_of_the_wrong_width_are_refused():
    """The kernel reads x as rows of in_features: a narrower tensor would be read past its end."""
    w = _q4k(32, 32)
    with pytest.raises(ValueError, match="expected rows of 256 inputs, got a tensor of shape \\(2, 255\\)"):
        w(torch.randn(2, 255))
    with pytest.raises(ValueError, match="shape \\(256,\\)"):
        w(torch.randn(256))


def test_q6_at_its_extremes_gives_the_avx2_bits_on_every_vnni_path(each_isa):
    """The VNNI pairs and panels sum a Q6_K group as two fp32 products of a sub-scale and a half's
    dot of levels - 32 (exact while |dot x sc| < 2^24), the AVX2 tiles as integers: at the largest
    magnitudes (levels 0 and 63, sub-scales -128 and 127, activations at +-127 after quantizing)
    both give one float, at 1 and 16 rows (pairs) and 40 (panels)."""
    n, k = 32, 512
    col = torch.arange(k)
    levels = torch.where((col // 16) % 2 == 0, 0, 63).repeat(n, 1).to(torch.uint8)
    levels[1::2] = 63 - levels[1::2]
    scales = torch.where(torch.arange(k // 16) % 3 == 0, -128, 127).repeat(n, 1).to(torch.int8)
    w = Q6Weight(levels, scales, torch.full((n, k // 32), 1e-3))
    x = torch.where((col // 16) % 2 == 0, -1.0, 1.0).repeat(40, 1)
    x[1::2] *= -1
    x[:, ::7] *= 0.5
    cpu_qgemm.set_isa("AVX2")
    want = [w(x[:rows]) for rows in (1, 16, 40)]
    each_isa(_VNNI)
    for rows, expected in zip((1, 16, 40), want):
        assert torch.equal(w(x[:rows]), expected), rows
    ref = (fake_quantize(x).double() @ w.dequantize_ref().double().T).float()
    assert (want[2] - ref).abs().max() <= 1e-6 * ref.abs().max()


@pytest.mark.parametrize("isa", ["AVX2", _VNNI])
@pytest.mark.parametrize("make", [_q4k, _q5_0, _q6, _q8], ids=["q4k", "q5_0", "q6", "q8"])
def test_a_narrow_matrix_at_two_threads_gives_the_one_thread_bits(make, isa, each_isa):
    """A prompt on a matrix of few tiles (100 weight rows: 13 tiles, 6 and 7 a thread) at 2 threads,
    alone and as a SplitWeight's part: the same bits as 1 thread."""
    each_isa(isa)
    w = make(100, 96)
    x = torch.randn(77, w.in_features)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = w(x)
        torch.set_num_threads(2)
        assert torch.equal(w(x), one)
        assert torch.equal(w(x[:64]), one[:64])
        split = SplitWeight([w, _q8(24, w.in_features, seed=3)])
        assert torch.equal(split(x)[:, :100], one)
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("isa", ["AVX2", _VNNI])
def test_a_split_weight_is_its_parts_side_by_side(isa, each_isa):
    """Parts in three formats (a Q6_K part of 40 rows: a tile cut at the boundary) in one call: the
    same bits as each part alone, side by side, whatever the rows; after `consolidate` too. On each
    instruction set: both tile copies write a part's columns at the whole row's stride."""
    each_isa(isa)
    parts = [_q4k(96, 32), _q6(40, 32, seed=1), _q8(24, 256, seed=2)]
    w = SplitWeight(parts)
    assert (w.out_features, w.in_features, w.nbytes) == (160, 256, sum(p.nbytes for p in parts))
    x = torch.randn(13, 256)
    alone = torch.cat([p(x) for p in parts], 1)
    assert torch.equal(w(x), alone)
    assert torch.equal(w(x[4:5]), alone[4:5])
    ids = torch.tensor([0, 95, 96, 135, 136, 159])
    assert torch.equal(w.rows(ids), torch.cat([p.dequantize_ref() for p in parts])[ids])
    cpu_qgemm.consolidate([w])
    assert torch.equal(w(x), alone)
    with pytest.raises(ValueError, match="2 to 4"):
        SplitWeight(parts[:1])
    with pytest.raises(ValueError, match="one input width"):
        SplitWeight([parts[0], _q8(8, 128)])


def test_the_isa_is_named_and_an_absent_one_is_refused(each_isa):
    assert cpu_qgemm.isa() in cpu_qgemm.ISA_NAMES.values()
    assert cpu_qgemm.set_isa("AVX2")
    if "avx512_vnni" not in cpu_build.cpu_flags():
        assert not cpu_qgemm.set_isa(_VNNI)
        assert cpu_qgemm.isa() == "AVX2"


def test_only_the_vnni_tiles_hold_avx512_instructions():
    """A CPU without AVX-512 must never meet one: the library's AVX-512 code (vpdpbusd, zmm or
    ymm16+ registers, mask registers) lives in `tile_rows_vnni` and the peak loops of
    `bench kernels` and the bf16 attention's alone, which run only where the CPU confirmed it."""
    import re
    import shutil
    import subprocess

    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump here to read the library's instructions")
    text = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(cpu_build.library().path)], capture_output=True,
                          text=True, check=True).stdout
    avx512 = re.compile(r"zmm|%ymm(1[6-9]|2\d|3[01])|%k[0-7]|vpdpbusd")
    holders, fn = set(), None
    for line in text.splitlines():
        head = re.match(r"[0-9a-f]+ <(.+)>:$", line)
        if head:
            fn = head.group(1)
        elif avx512.search(line):
            holders.add(fn)
    # The bf16 attention's entry points (cpu_attention_bf16.h), run where paged_attention confirmed
    # AVX512_BF16, and the fp32 tiles' and lone rows' (cpu_attention_avx512.h), run where the GEMM
    # tiles run with AVX-512; GCC names its clones `name.isra.0`, `name.constprop.1`.
    names = {fn.split(".")[0] for fn in holders}
    assert names <= {"tile_rows_vnni", "pair_rows_vnni", "panel_rows_vnni", "int8_peak_vnni", "fp32_peak_vnni",
                     "tile_chunk_bf16", "bf16_queries", "tile_scores_avx512", "tile_values_avx512",
                     "chunk_exp_avx512", "row_scores_avx512", "row_values_avx512"}, holders
    assert "tile_rows_vnni" in holders
