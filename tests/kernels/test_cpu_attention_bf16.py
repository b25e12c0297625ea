"""The C attention's bf16 dot products (cpu_attention_bf16.h, CPUs with AVX512_BF16) against their
torch reference (app/kernels/reference_bf16.py), and the engine's property on that path too: a row's
numbers do not depend on the batch around it, on how its prompt was chunked, on the threads, or on
whether it came in a prompt chunk or alone as a decode (bit for bit). The switch that keeps fp32."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from app.kernels import cpu_attention
from app.kernels.reference_bf16 import unified_attention_bf16_ref
from app.kernels.settings import KernelSettings
from tests.kernels.test_cpu_attention import FP32_CASES, LONG, TILES, _batched, _run, c_attention, scales
from tests.kernels.test_kernels import SENTINEL, AttnCase, attention_error, attention_metadata, make_attention_inputs

pytestmark = pytest.mark.skipif(
    cpu_attention._library() is None or not cpu_attention.bf16_supported(),
    reason="this CPU lacks AVX512_BF16 (or the C kernels cannot build): the bf16 attention cannot run here",
)


def bf16_attention(*args, **kwargs) -> torch.Tensor:
    return c_attention(*args, **kwargs, bf16=True)


def bf16_error(case: AttnCase, inputs: dict) -> float:
    """‖kernel − bf16 reference‖ / ‖bf16 reference‖ over the sequences' rows."""
    scale, meta = case.head_dim**-0.5, attention_metadata(inputs)
    args = [inputs[n] for n in ("q", "k_cache", "v_cache")]
    out, ref = (torch.full_like(inputs["q"], SENTINEL) for _ in range(2))
    bf16_attention(*args, out, meta, scale, case.window, case.softcap, **scales(inputs))
    unified_attention_bf16_ref(*args, ref, meta, scale, case.window, case.softcap, **scales(inputs))
    used = sum(case.q_lens)
    return ((out[:used] - ref[:used]).norm() / ref[:used].norm()).item()


REFERENCE_CASES = [name for name in FP32_CASES if not name.startswith(("decode-fp16", "decode-bf16", "decode-block"))]


@pytest.mark.parametrize("name", REFERENCE_CASES)
def test_bf16_attention_matches_its_reference(name: str) -> None:
    """Within fp32 noise of the bf16 reference (the exp's ulps can flip a weight's bf16 rounding), and
    about bf16's rounding away from the fp32 reference: the bf16 arithmetic ran."""
    case = FP32_CASES[name]
    inputs = make_attention_inputs(case)
    assert bf16_error(case, inputs) < 1e-4
    err, kept = attention_error(case, inputs, bf16_attention)
    assert 1e-4 < err < 1e-2, f"{name}: relative error to the fp32 reference {err:.2e}"
    assert kept, f"{name}: rows outside every sequence were written"


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("cache_dtype", ["float32", "float16", "int8"])
@pytest.mark.parametrize("shape", list(TILES))
def test_a_bf16_tile_of_rows_is_each_row_alone(shape: str, cache_dtype: str, threads: int) -> None:
    """test_cpu_attention's tiles (37 rows ending at 530 keys, 17 at 40) on the bf16 path: each row equals
    the same row alone (a decode), bit for bit, and the bf16 reference."""
    spec = dict(TILES[shape])
    window, softcap = spec.pop("window", None), spec.pop("softcap", None)
    case = AttnCase(q_lens=(37, 17), seq_lens=(530, 40), dtype="float32", cache_dtype=cache_dtype, window=window,
                    softcap=softcap, **spec)
    inputs = make_attention_inputs(case)
    batched = _batched(inputs, threads, window, softcap, bf16=True)
    alone = []
    for seq, (q_len, seq_len) in enumerate(zip(case.q_lens, case.seq_lens)):
        start = sum(case.q_lens[:seq])
        for i in range(q_len):
            row = slice(start + i, start + i + 1)
            alone.append(_run(inputs, [0, 1], [seq_len - q_len + i + 1], row, [seq], window, softcap, bf16=True))
    assert torch.equal(batched, torch.cat(alone))
    assert bf16_error(case, inputs) < 1e-4


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("cache_dtype", ["float32", "int8"])
def test_a_bf16_row_is_the_same_alone_batched_and_chunked(window: int | None, cache_dtype: str) -> None:
    """Sequence 2 of MIXED (a 19-token first chunk) inside the mixed batch, alone, as 11 + 8 rows and
    as 18 + 1 (its last row a decode): bit-identical rows."""
    case = replace(FP32_CASES["mixed-gqa3"], window=window, cache_dtype=cache_dtype)
    inputs = make_attention_inputs(case)
    batched = _batched(inputs, 1, window, bf16=True)
    start = sum(case.q_lens[:2])
    mine = slice(start, start + 19)
    alone = _run(inputs, [0, 19], [19], mine, [2], window, bf16=True)
    chunks = [_run(inputs, [0, a1 - a0], [a1], slice(start + a0, start + a1), [2], window, bf16=True)
              for a0, a1 in ((0, 11), (11, 19))]
    decode = [_run(inputs, [0, a1 - a0], [a1], slice(start + a0, start + a1), [2], window, bf16=True)
              for a0, a1 in ((0, 18), (18, 19))]
    assert torch.equal(batched[mine], alone)
    assert torch.equal(alone, torch.cat(chunks)) and torch.equal(alone, torch.cat(decode))


@pytest.mark.parametrize("threads", [1, 3, 8])
@pytest.mark.parametrize("cache_dtype", ["float32", "float16", "int8"])
def test_a_long_bf16_row_is_the_same_alone_batched_and_chunked(threads: int, cache_dtype: str) -> None:
    """Rows read in partitions (LONG: a 3-row chunk at 597-599, decodes at 1100 and 1537 keys) inside the
    batch, alone, and split 2 + 1 rows, on 1, 3 and 8 threads (a decode's heads split between them)."""
    inputs = make_attention_inputs(replace(LONG, cache_dtype=cache_dtype))
    batched = _batched(inputs, threads, bf16=True)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        decode = _run(inputs, [0, 1], [1537], slice(4, 5), [2], bf16=True)
    finally:
        torch.set_num_threads(previous)
    chunk = _run(inputs, [0, 3], [600], slice(1, 4), [1], bf16=True)
    split = torch.cat((_run(inputs, [0, 2], [599], slice(1, 3), [1], bf16=True),
                       _run(inputs, [0, 1], [600], slice(3, 4), [1], bf16=True)))
    assert torch.equal(batched[4:5], decode)
    assert torch.equal(batched[1:4], chunk) and torch.equal(chunk, split)


def test_bf16_is_chosen_when_asked_where_the_cpu_has_it() -> None:
    on = KernelSettings.from_env({"LOCALBATCH_CPU_ATTENTION_BF16": "1"})
    assert not cpu_attention.bf16_attention(KernelSettings.from_env({}))  # off by default (docs/tuning.md)
    assert cpu_attention.bf16_attention(on)
    assert not cpu_attention.bf16_attention(KernelSettings(attention_bf16=True, isa="avx2"))  # AVX2 kernels
    assert on.describe() == "LOCALBATCH_CPU_ATTENTION_BF16=1"
    assert cpu_attention.math_name(on).startswith("bf16")
    assert cpu_attention.math_name(KernelSettings()) == "fp32 (FMA)"


def test_the_fp32_switch_gives_the_fp32_kernel() -> None:
    """bf16=False: the fp32 path, whatever the CPU (test_cpu_attention holds its bits)."""
    case = FP32_CASES["mixed-gqa3"]
    inputs = make_attention_inputs(case)
    fp32, bf16 = (_batched(inputs, 1, bf16=flag) for flag in (False, True))
    assert not torch.equal(fp32, bf16)
    err, _ = attention_error(case, inputs, c_attention)
    assert err < 1e-5
