"""Structured output and logit_bias through the engine: tiny random-weight GGUFs (their own small
tokenizers) and, where a real vocabulary matters, the pulled SmolLM2 chat model."""

from __future__ import annotations

import pytest

from app.engine.api.errors import RequestError
from app.engine.api.sampling_params import SamplingParams
from app.engine.core.llm_engine import LLMEngine


def make_engine(path, **kw) -> LLMEngine:
    settings = {"device": "cpu", "dtype": "float32", "block_size": 4, "kv_cache_blocks": 256, "max_num_batched_tokens": 512}
    settings.update(kw)
    return LLMEngine(str(path), **settings)


def run(engine: LLMEngine, prompts: list, params: list[SamplingParams]) -> list:
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
    return seqs


@pytest.fixture(scope="module")
def qwen_path(tiny_gguf_factory):
    return tiny_gguf_factory("qwen3")  # byte-level BPE vocabulary


@pytest.fixture(scope="module")
def qwen_engine(qwen_path):
    return make_engine(qwen_path)


# --- logit_bias ---


def test_logit_bias_forces_and_bans(qwen_engine):
    prompt = [5, 6, 7, 8]
    plain, = run(qwen_engine, [prompt], [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)])
    banned = plain.output_token_ids[0]
    forced, without = run(qwen_engine, [prompt, prompt], [
        SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True, logit_bias={42: 100}),
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias={str(banned): -100}),
    ])
    assert forced.output_token_ids == [42] * 6
    assert banned not in without.output_token_ids


def test_logit_bias_outside_the_vocabulary_is_a_request_error(qwen_engine):
    vocab = qwen_engine.model_config.vocab_size
    with pytest.raises(RequestError) as err:
        qwen_engine.add_request([5, 6], SamplingParams(logit_bias={vocab: 1.0}))
    assert err.value.param == "logit_bias" and str(vocab) in str(err.value)
    assert not qwen_engine.has_unfinished()
