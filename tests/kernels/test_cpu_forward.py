"""The decoder layers in one C call (app/kernels/cpu_forward.c) against the Python layers calling
the same kernels one by one: the same tokens and logprobs, bit for bit, for each tiny architecture
that takes it (a sliding-window Gemma 3 with its two KV cache groups and two RoPE tables, Qwen3's
q/k norms, Qwen2's q/k/v biases), with prefill chunks and a mixed batch."""

from __future__ import annotations

import pytest

from app.engine.core.llm_engine import LLMEngine
from app.engine.types.sampling_params import SamplingParams
from app.kernels import cpu_forward

pytestmark = pytest.mark.skipif(
    cpu_forward._library() is None, reason="no C compiler or no AVX2/FMA/F16C here: the C kernels cannot build"
)


def _generate(path, c_layers: bool, kv_cache_dtype: str = "auto") -> list[tuple[list[int], list]]:
    engine = LLMEngine(str(path), device="cpu", dtype="float32", block_size=4, kv_cache_blocks=512,
                       max_num_batched_tokens=24, kv_cache_dtype=kv_cache_dtype)  # prompts in chunks, beside decodes
    assert engine.worker.model.c_layers is not None
    if not c_layers:
        engine.worker.model.c_layers = None
    seqs = [engine.add_request([(7 * i + 3 * j) % 200 + 5 for j in range(9 + 13 * i)],
                               SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3))
            for i in range(3)]
    while engine.has_unfinished():
        engine.step()
    return [(s.output_token_ids, s.logprobs) for s in seqs]


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3", "qwen2"])
def test_one_call_equals_the_layers_one_by_one(arch, tiny_gguf_factory):
    path = tiny_gguf_factory(arch)
    assert _generate(path, True) == _generate(path, False)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_one_call_over_an_int8_kv_cache(arch, tiny_gguf_factory):
    path = tiny_gguf_factory(arch)
    assert _generate(path, True, "int8") == _generate(path, False, "int8")


def test_a_bias_beyond_qkv_keeps_the_layers_one_by_one(tiny_gguf_factory):
    engine = LLMEngine(str(tiny_gguf_factory("qwen2")), device="cpu", dtype="float32", kv_cache_blocks=64)
    layers = engine.worker.model.layers
    assert cpu_forward.takes_layers(layers)
    layers[0].o_proj.bias = layers[0].qkv.bias[: layers[0].o_proj.packed.out_features].clone()
    assert not cpu_forward.takes_layers(layers)  # forward_layers adds q, k and v's biases only


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_one_call_takes_the_bf16_attention_as_the_layers_do(arch, tiny_gguf_factory, monkeypatch):
    """LOCALBATCH_CPU_ATTENTION_BF16=1, read into the model's plan: the one call and the layers one by one
    both run the bf16 attention (the same bits), which differs from the fp32 one."""
    from app.kernels import cpu_attention

    if not cpu_attention.bf16_supported():
        pytest.skip("this CPU lacks AVX512_BF16: the bf16 attention cannot run here")
    path = tiny_gguf_factory(arch)
    fp32 = _generate(path, True)
    monkeypatch.setenv("LOCALBATCH_CPU_ATTENTION_BF16", "1")
    bf16 = _generate(path, True)
    assert bf16 == _generate(path, False) and bf16 != fp32
