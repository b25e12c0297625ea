"""The C paged attention and KV store of the fp32 CPU path (app/kernels/cpu_attention.c) against
the torch reference, over fp32, fp16 and int8 caches, and the property the engine relies on: a
row's numbers do not depend on the batch around it or on how its prompt was chunked (bit for bit)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from app import kernels
from app.engine.runtime.decoder import DecoderLayer, RotaryEmbedding
from app.engine.runtime.kernel_plan import Attention, KernelPlan, RowOps
from app.kernels import KVCacheLayer, cpu_attention, cpu_qgemm, registry
from app.kernels.registry import AttentionRequest
from app.kernels.settings import KernelSettings
from tests.kernels.test_kernels import (
    ATTN_CASES, AttnCase, SENTINEL, STORE_CASES, attention_error, attention_metadata, make_attention_inputs, store_error,
)

pytestmark = pytest.mark.skipif(
    cpu_attention._library() is None, reason="no C compiler or no AVX2/FMA/F16C here: the C kernels cannot build"
)

# Every case the kernel takes: fp32 queries over an fp32 cache, head sizes a multiple of 8.
FP32_CASES = {
    name: replace(case, dtype="float32", cache_dtype="float32")
    for name, case in ATTN_CASES.items()
    if case.cache_dtype in (None, "float32", "float16", "bfloat16") and case.head_dim % 8 == 0
}
# An fp16 cache (`--kv-cache-dtype float16`): the kernel widens each element as it reads it.
FP32_CASES.update({
    f"{name}-fp16-cache": replace(FP32_CASES[name], cache_dtype="float16")
    for name in ("decode-fp32-gqa1", "decode-gemma-d256", "mixed-gqa3", "window-short", "softcap", "padding-tokens")
})


# An int8 cache (`--kv-cache-dtype int8`): scores times the keys' scales, weights times the values'.
FP32_CASES.update({
    f"{name}-int8-cache": replace(FP32_CASES[name], cache_dtype="int8")
    for name in ("decode-fp32-gqa1", "decode-gemma-d256", "mixed-gqa3", "window-short", "softcap", "padding-tokens")
})
FP32_CASES.update({  # the reference's int8 cases: NaN scales wherever the kernel must not read
    name: replace(case, dtype="float32") for name, case in ATTN_CASES.items() if case.cache_dtype == "int8"
})

# Rows of more than 512 keys (the kernel's KEY_PARTITION): read in partitions, merged at the end.
LONG = replace(FP32_CASES["decode-fp32-gqa1"], q_lens=(1, 3, 1), seq_lens=(1100, 600, 1537), heads=6, kv_heads=2,
               head_dim=16)
FP32_CASES.update({
    "long-partitions": LONG,
    "long-partitions-fp16-cache": replace(LONG, cache_dtype="float16"),
    "long-partitions-int8-cache": replace(LONG, cache_dtype="int8"),
    "long-partitions-window": replace(LONG, window=700),
})


def c_attention(*args, k_scale=None, v_scale=None, bf16=False) -> torch.Tensor:
    """The C kernel; fp32 dot products unless `bf16` (test_cpu_attention_bf16.py holds those)."""
    q, k_cache = args[0], args[1]
    assert kernels.attention_backend(q, k_cache, k_scale) == "c"
    return cpu_attention.unified_attention(*args, k_scale=k_scale, v_scale=v_scale, bf16=bf16)


def scales(inputs: dict) -> dict:
    """An int8 cache's scales from `make_attention_inputs`, as keyword arguments (none otherwise)."""
    return {n: inputs[n] for n in ("k_scale", "v_scale") if n in inputs}


@pytest.mark.parametrize("name", list(FP32_CASES))
def test_attention_matches_reference(name: str) -> None:
    case = FP32_CASES[name]
    err, kept = attention_error(case, make_attention_inputs(case), c_attention)
    assert err < 1e-5, f"{name}: relative error {err:.2e}"  # int8 too: it widens exactly, sums in fp32
    assert kept, f"{name}: rows outside every sequence were written"


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("name", ["decode-gemma-d256", "decode-gemma-d256-int8-cache"])
def test_attention_is_the_same_on_any_thread_count(threads: int, name: str) -> None:
    case = FP32_CASES[name]
    inputs = make_attention_inputs(case)
    outs = []
    previous = torch.get_num_threads()
    try:
        for n in (1, threads):
            torch.set_num_threads(n)
            out = torch.full_like(inputs["q"], SENTINEL)
            c_attention(inputs["q"], inputs["k_cache"], inputs["v_cache"], out, attention_metadata(inputs), 0.0625,
                        case.window, case.softcap, **scales(inputs))
            outs.append(out)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(outs[0], outs[1])


def _run(inputs: dict, cu: list[int], seq_lens: list[int], rows: slice, blocks: list[int], window=None,
         softcap=None, bf16=False) -> torch.Tensor:
    meta = kernels.AttentionMetadata(
        torch.tensor(cu, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
        inputs["block_table"][blocks],
    )
    q = inputs["q"][rows].contiguous()
    out = torch.empty_like(q)
    return c_attention(q, inputs["k_cache"], inputs["v_cache"], out, meta, 0.2, window, softcap, **scales(inputs),
                       bf16=bf16)


def _batched(inputs: dict, threads: int, window=None, softcap=None, bf16=False) -> torch.Tensor:
    """Every row of `inputs` in one call on `threads` threads (the torch setting restored after)."""
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = torch.empty_like(inputs["q"])
        return c_attention(inputs["q"], inputs["k_cache"], inputs["v_cache"], out, attention_metadata(inputs), 0.2,
                           window, softcap, **scales(inputs), bf16=bf16)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("cache_dtype", ["float32", "int8"])
def test_a_row_is_the_same_alone_batched_and_chunked(window: int | None, cache_dtype: str) -> None:
    """Sequence 2 (a 19-token first chunk in MIXED) computed inside the mixed batch, alone, and as
    two chunks of 11 and 8 rows: bit-identical rows."""
    case = replace(FP32_CASES["mixed-gqa3"], window=window, cache_dtype=cache_dtype)
    inputs = make_attention_inputs(case)
    meta = attention_metadata(inputs)
    batched = torch.empty_like(inputs["q"])
    c_attention(inputs["q"], inputs["k_cache"], inputs["v_cache"], batched, meta, 0.2, window, None, **scales(inputs))
    start = sum(case.q_lens[:2])
    mine = slice(start, start + 19)
    alone = _run(inputs, [0, 19], [19], mine, [2], window)
    first = _run(inputs, [0, 11], [11], slice(start, start + 11), [2], window)
    second = _run(inputs, [0, 8], [19], slice(start + 11, start + 19), [2], window)
    assert torch.equal(batched[mine], alone)
    assert torch.equal(alone, torch.cat((first, second)))


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("cache_dtype", ["float32", "int8"])
def test_a_long_row_is_the_same_alone_batched_and_chunked(threads: int, cache_dtype: str) -> None:
    """Rows read in partitions: the 3-row chunk of sequence 1 (positions 597-599) and sequence 2's
    decode at 1537 keys, inside the batch, alone, and split 2 + 1 rows, on 1 and 3 threads."""
    inputs = make_attention_inputs(replace(LONG, cache_dtype=cache_dtype))
    batched = _batched(inputs, threads)
    decode = _run(inputs, [0, 1], [1537], slice(4, 5), [2])
    chunk = _run(inputs, [0, 3], [600], slice(1, 4), [1])
    split = torch.cat((_run(inputs, [0, 2], [599], slice(1, 3), [1]), _run(inputs, [0, 1], [600], slice(3, 4), [1])))
    assert torch.equal(batched[4:5], decode)
    assert torch.equal(batched[1:4], chunk) and torch.equal(chunk, split)


# A sequence's rows, 16 or more (a prompt chunk), go through the kernel as tiles: 16 rows x one KV head's
# query heads. Shapes of the catalog's models and the tiles' remainders: 1 to 5 vectors past the
# last whole six, 1 or 2 past the last triple, a head size that is not a multiple of 32, a tile of fewer rows
# (MQA: 32 heads a KV head), rows that cross the 512-key partition, a softcap, a window none reaches.
TILES = {
    "gqa6-d128": dict(heads=12, kv_heads=2, head_dim=128),  # Qwen2.5-Coder-1.5B
    "gqa3-d64": dict(heads=9, kv_heads=3, head_dim=64),  # SmolLM2-135M
    "gqa7-d64": dict(heads=14, kv_heads=2, head_dim=64),  # Qwen2.5-Coder-0.5B
    "gqa5-d40-softcap": dict(heads=5, kv_heads=1, head_dim=40, softcap=20.0),
    "gqa1-d32": dict(heads=2, kv_heads=2, head_dim=32),
    "mqa32-d16-window": dict(heads=32, kv_heads=1, head_dim=16, window=600),
}


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("cache_dtype", ["float32", "float16", "int8"])
@pytest.mark.parametrize("shape", list(TILES))
def test_a_tile_of_rows_is_each_row_alone(shape: str, cache_dtype: str, threads: int) -> None:
    """A 37-row prompt chunk ending at 530 keys (tiles of 16, 16 and 5 rows) and a 17-row one ending at 40
    (16 and 1), in one batch: each row equals the same row computed alone (the one-row path), bit for bit."""
    spec = dict(TILES[shape])
    window, softcap = spec.pop("window", None), spec.pop("softcap", None)
    case = AttnCase(q_lens=(37, 17), seq_lens=(530, 40), dtype="float32", cache_dtype=cache_dtype, window=window,
                    softcap=softcap, **spec)
    inputs = make_attention_inputs(case)
    batched = _batched(inputs, threads, window, softcap)
    alone = []
    for seq, (q_len, seq_len) in enumerate(zip(case.q_lens, case.seq_lens)):
        start = sum(case.q_lens[:seq])
        for i in range(q_len):
            row = slice(start + i, start + i + 1)
            alone.append(_run(inputs, [0, 1], [seq_len - q_len + i + 1], row, [seq], window, softcap))
    assert torch.equal(batched, torch.cat(alone))
    err, _ = attention_error(case, inputs, c_attention)
    assert err < 1e-5, f"{shape}: relative error {err:.2e}"


@pytest.fixture
def avx512_then_avx2():
    """The tiles' zmm loops (where the GEMM tiles run with AVX-512), then the ymm ones (AVX2 chosen);
    the machine's own choice restored after. Skipped where this CPU lacks AVX-512 VNNI."""
    chosen = cpu_qgemm.isa()
    if not cpu_qgemm.set_isa("AVX-512 VNNI"):
        pytest.skip("this CPU lacks AVX-512 VNNI (cpuid or the OS's registers): the zmm tiles cannot run")
    yield lambda: cpu_qgemm.set_isa("AVX2")
    cpu_qgemm.set_isa(chosen)


@pytest.mark.parametrize("cache_dtype", ["float16", "int8"])
@pytest.mark.parametrize("shape", list(TILES))
def test_the_avx512_tiles_give_the_avx2_bits(shape: str, cache_dtype: str, avx512_then_avx2) -> None:
    """A 40-row chunk over 600 keys and a 19-row one over 77 (tiles of 16, 16, 8; 16, 3): every output bit
    the same with the tiles on zmm registers as on ymm ones (each lane the same fmas, each score the
    same sum tree)."""
    spec = dict(TILES[shape])
    window, softcap = spec.pop("window", None), spec.pop("softcap", None)
    case = AttnCase(q_lens=(40, 19), seq_lens=(600, 77), dtype="float32", cache_dtype=cache_dtype, window=window,
                    softcap=softcap, **spec)
    inputs = make_attention_inputs(case)
    zmm = _batched(inputs, 2, window, softcap)
    avx512_then_avx2()
    assert torch.equal(zmm, _batched(inputs, 2, window, softcap))


@pytest.mark.parametrize("cache_dtype", ["float32", "float16", "int8"])
@pytest.mark.parametrize("shape", list(TILES))
def test_the_avx512_lone_rows_give_the_avx2_bits(shape: str, cache_dtype: str, avx512_then_avx2) -> None:
    """Decode rows (too few for a tile: each row alone) over 1,100, 77 and 600 keys, with chunk tails of
    1 to 7 keys past the last eight: every output bit the same with the lone rows' loops on zmm
    registers, straight from the pool, as on ymm ones."""
    spec = dict(TILES[shape])
    window, softcap = spec.pop("window", None), spec.pop("softcap", None)
    case = AttnCase(q_lens=(1, 1, 3), seq_lens=(1100, 77, 603), dtype="float32", cache_dtype=cache_dtype,
                    window=window, softcap=softcap, **spec)
    inputs = make_attention_inputs(case)
    zmm = [_batched(inputs, threads, window, softcap) for threads in (1, 2)]
    avx512_then_avx2()
    assert torch.equal(zmm[0], zmm[1]) and torch.equal(zmm[0], _batched(inputs, 2, window, softcap))


@pytest.mark.parametrize("cache_dtype", ["float32", "float16", "int8"])
def test_a_lone_row_over_an_odd_number_of_partitions_is_the_same_on_any_thread_count(cache_dtype: str) -> None:
    """A lone decode row over 2,100 keys (five 512-key partitions): on 2 and 4 threads its last partition
    is split by KV head between them; every output bit the same as on 1 and 3 threads, and as the
    reference."""
    case = AttnCase(q_lens=(1,), seq_lens=(2100,), dtype="float32", cache_dtype=cache_dtype, heads=9, kv_heads=3,
                    head_dim=64)
    inputs = make_attention_inputs(case)
    outs = [_batched(inputs, threads) for threads in (1, 2, 3, 4)]
    assert all(torch.equal(outs[0], out) for out in outs[1:])
    err, _ = attention_error(case, inputs, c_attention)
    assert err < 1e-5, f"relative error {err:.2e}"


@pytest.mark.parametrize("cache_dtype", ["float32", "float16", "int8"])
def test_store_matches_reference(cache_dtype: str) -> None:
    """fp16: rounded to nearest even, as torch's cast; int8: quantize_kv_ref's codes and scales, a
    zero row included: the same bits."""
    spec = dict(STORE_CASES["kv_heads3-head_dim48"], cache_dtype=cache_dtype, zero_row=cache_dtype == "int8")
    dtype = getattr(torch, cache_dtype)
    scale = torch.zeros(1, 16, 3) if dtype == torch.int8 else None
    assert kernels.attention_backend(torch.zeros(1, 3, 48), torch.zeros(1, 16, 3, 48, dtype=dtype), scale) == "c"
    assert store_error(spec, kernels.store_kv) == 0.0
    assert store_error(dict(spec, fused=True), kernels.store_kv) == 0.0


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize("style,qk_norm", [("neox", False), ("normal", False), ("neox", True)])
def test_rope_store_matches_the_torch_ops(cache_dtype, style: str, qk_norm: bool) -> None:
    """q/k norm, RoPE and the KV store in one C pass over the qkv projection: the same q and the same
    cache bits as the torch ops it replaces; a padding row (slot -1) stores nothing."""
    heads, kv_heads, d, tokens = 6, 2, 32, 5
    rope = RotaryEmbedding(d, 64, 10000.0, style, 1.0, "cpu")
    layer = SimpleNamespace(
        cfg=SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=d, rms_norm_eps=1e-6),
        qk_norm=torch.randn(heads + kv_heads, d) if qk_norm else None, rope=rope, q_size=heads * d,
        kv_size=kv_heads * d, ops=RowOps.C,  # the C norm either way: the two paths differ only in RoPE and store
    )
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d) * 2
    tables = rope.tables(torch.tensor([0, 3, 17, 40, 63]))
    meta = kernels.AttentionMetadata(torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([tokens], dtype=torch.int32),
                                     torch.zeros(1, 4, dtype=torch.int32), torch.tensor([9, 0, 31, -1, 16]))
    outs = []
    assert _model_attention(cache_dtype, heads, d) == "c"
    for plan in (KernelPlan(RowOps.TORCH, Attention.C), KernelPlan(RowOps.TORCH, Attention.TORCH)):
        layer.plan = plan
        scale = {"k_scale": torch.full((2, 16, kv_heads), 7.0), "v_scale": torch.full((2, 16, kv_heads), 7.0)}
        kv = KVCacheLayer(torch.full((2, 16, kv_heads, d), 7.0).to(cache_dtype),
                          torch.full((2, 16, kv_heads, d), 7.0).to(cache_dtype),
                          **(scale if cache_dtype == torch.int8 else {}))
        outs.append((DecoderLayer.rope_store(layer, qkv, tables, kv, meta), kv.k, kv.v, kv.k_scale, kv.v_scale))
    for c, ref in zip(*outs):
        assert (c is None and ref is None) or torch.equal(c, ref)
    assert (outs[0][1].view(-1, kv_heads, d)[[1, 2, 3, 4, 5, 6, 7, 8]] == 7.0).all()  # untouched slots


def test_the_torch_backend_can_be_chosen(monkeypatch) -> None:
    monkeypatch.setenv(cpu_attention.BACKEND_ENV, "torch")
    assert kernels.attention_backend(torch.zeros(1, 4, 32), torch.zeros(1, 16, 1, 32), None) == "torch"
    assert _model_attention(torch.float32, 4, 32) == "torch"


@pytest.mark.parametrize("q_dtype,cache_dtype,head_dim", [
    (torch.bfloat16, torch.bfloat16, 32), (torch.float32, torch.float8_e4m3fn, 32), (torch.float32, torch.float32, 12),
])
def test_what_the_kernel_does_not_take_goes_to_the_reference(q_dtype, cache_dtype, head_dim) -> None:
    scale = torch.ones(1, 16, 1) if cache_dtype == torch.float8_e4m3fn else None
    assert kernels.attention_backend(torch.zeros(1, 4, head_dim, dtype=q_dtype),
                                     torch.zeros(1, 16, 1, head_dim, dtype=cache_dtype), scale) == "torch"


def _model_attention(cache_dtype: torch.dtype, heads: int, head_dim: int) -> str:
    """The registry's attention for a model's block (paged attention, store and the fused RoPE pass)."""
    request = AttentionRequest("cpu", torch.float32, cache_dtype, heads, head_dim, rope=True,
                               settings=KernelSettings.from_env())
    return registry.choose("attention", request).name


@pytest.mark.parametrize("head_dim,call,model", [(48, "c", "c"), (24, "c", "torch"), (12, "torch", "torch"),
                                                 (512, "c", "c"), (528, "c", "torch")])
def test_a_model_needs_both_c_kernels_a_call_needs_the_paged_one(head_dim: int, call: str, model: str) -> None:
    """Paged attention and the store take whole 8-lane vectors; the fused RoPE pass (a model's block
    only) takes 16-lane halves up to its 512-value row buffers: one declaration each, composed."""
    assert kernels.attention_backend(torch.zeros(1, 2, head_dim), torch.zeros(1, 16, 1, head_dim), None) == call
    assert _model_attention(torch.float32, 2, head_dim) == model
    reasons = dict((e.name, why) for e, why in registry.verdicts("attention", AttentionRequest(
        "cpu", torch.float32, torch.float32, 2, head_dim, rope=True)))
    assert reasons["triton"] == "CUDA only" and reasons["torch"] is None
    assert (reasons["c"] is None) == (model == "c")
