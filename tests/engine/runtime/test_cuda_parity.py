"""The whole engine on a CUDA GPU (Triton attention, CUDA graphs or eager) gives the tokens and
logprobs of plain fp32 torch on the CPU, for every architecture, batched. Skipped without CUDA.

The CPU reference turns off what the CPU path does differently on purpose: 8-bit weight groups with
quantized activations (llama.cpp's own arithmetic, tested against its oracle elsewhere), fp16 weight
copies and the fp16 KV cache of "auto". Against the default CPU path a tiny random model already
differs by ~0.2 nats and flips near-tied tokens, which says nothing about the GPU.
"""

from __future__ import annotations

import pytest
import torch

from app.engine.core.llm_engine import LLMEngine
from app.engine.types.sampling_params import SamplingParams
from tests.engine.core.test_engine import make_engine, prompts

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PLAIN_FP32_CPU = {
    "LOCALBATCH_LINEAR_KERNEL": "dense",
    "LOCALBATCH_CPU_ATTENTION": "torch",
    "LOCALBATCH_CPU_QUANT_KERNELS": "0",
}
LOGPROB_TOLERANCE = 1e-4  # fp32 summation order only (seen: <= 2.1e-5 on an H100)


def generate(engine: LLMEngine, reqs: list[list[int]]) -> list[tuple[list[int], list[dict[int, float]]]]:
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    seqs = [engine.add_request(p, params) for p in reqs]
    while engine.has_unfinished():
        engine.step()
    return [(s.output_token_ids, s.logprobs) for s in seqs]


@pytest.mark.parametrize("weight_type", ["F32", "Q8_0"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_cuda_engine_matches_plain_fp32_on_the_cpu(tiny_gguf_factory, monkeypatch, arch, weight_type, eager) -> None:
    path = tiny_gguf_factory(arch, weight_type=weight_type)
    reqs = prompts(8, seed=1, hi=60)
    with monkeypatch.context() as m:
        for name, value in PLAIN_FP32_CPU.items():
            m.setenv(name, value)
        ref = generate(make_engine(path, kv_cache_dtype="float32"), reqs)
    engine = make_engine(path, device="cuda", kv_cache_dtype="float32", enforce_eager=eager)
    assert bool(engine.worker.runner.graphs and engine.worker.runner.graphs.graphs) != eager
    got = generate(engine, reqs)
    for (ref_ids, ref_lps), (ids, lps) in zip(ref, got):
        assert ids == ref_ids
        for ref_top, top in zip(ref_lps, lps):
            assert max(abs(ref_top[t] - top[t]) for t in top.keys() & ref_top.keys()) < LOGPROB_TOLERANCE


def test_async_engine_on_cuda_streams_the_offline_tokens(tiny_gguf_factory) -> None:
    """On a GPU a step's deltas go out once the next step is launched: 8 streams at once still get
    every token of the offline run, in order, and each its finish."""
    import asyncio

    from app.engine.api.async_engine import AsyncEngine

    path = tiny_gguf_factory("llama")
    reqs = prompts(8, seed=2, hi=30)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    offline = make_engine(path, device="cuda")
    seqs = [offline.add_request(p, params) for p in reqs]
    while offline.has_unfinished():
        offline.step()
    engine = AsyncEngine(str(path), device="cuda", dtype="float32", block_size=4, kv_cache_blocks=2048)
    try:
        assert engine._publish_at_launch

        async def one(prompt):
            return [d async for d in engine.stream(prompt, params)]

        async def together():
            return await asyncio.gather(*(one(p) for p in reqs))

        for seq, deltas in zip(seqs, asyncio.run(together())):
            assert [t for d in deltas for t in d.token_ids] == seq.output_token_ids
            assert deltas[-1].finish_reason == "length"
    finally:
        engine.close()
