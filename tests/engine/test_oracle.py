"""The models localbatch ships or pulls, against llama.cpp's reference data (../shared/oracle), by
the tolerance rule of its README, with fp32 compute: the embedded Gemma 3 270M (a base model) and
X. An int8 KV cache
(`kv_cache_dtype="int8"`) is held to the README's bf16 rule for teacher-forced agreement."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from app.engine import LLM, SamplingParams
from app.engine.runtime import kernel_choice
from app.engine.runtime.weight_forms import Int4Weight
from tests.support.oracle import ORACLE_DIR, needs_oracle

SMOLLM2_GGUF = os.environ.get("LOCALBATCH_SMOLLM2_GGUF")

pytestmark = [
    pytest.mark.slow,
    needs_oracle,
]


# oracle file -> catalog name of the pulled chat models (the embedded Gemma is always there)
PULLED = {
    "smollm2_135m_instruct": "smollm2-135m-instruct",
    "qwen2.5_coder_0.5b_instruct": "qwen2.5-coder-0.5b-instruct",
    "qwen2.5_coder_1.5b_instruct": "qwen2.5-coder-1.5b-instruct",
}


def _pulled_path(name: str) -> Path:
    if name == "smollm2_135m_instruct" and SMOLLM2_GGUF:
        return Path(SMOLLM2_GGUF)
    from app.engine.gguf.catalog import installed_path

    path = installed_path(PULLED[name])
    if path is None:
        pytest.skip(f"{PULLED[name]} is not pulled: run `localbatch pull {PULLED[name]}` (.ci/run does)")
    return path


def _model_path(request, name: str) -> Path:
    return request.getfixturevalue("embedded_model_path") if name == "gemma3_270m" else _pulled_path(name)


MODELS = ["gemma3_270m", "smollm2_135m_instruct", "qwen2.5_coder_0.5b_instruct", "qwen2.5_coder_1.5b_instruct"]
QWEN = MODELS[2:]


def _load(request, name: str, **engine_kwargs) -> tuple[dict, LLM]:
    path = _model_path(request, name)
    oracle = json.loads((ORACLE_DIR / f"{name}.json").read_text())
    return oracle, LLM(str(path), device="cpu", dtype="float32", kv_cache_blocks=512, **engine_kwargs)


@pytest.fixture(scope="module", params=MODELS)
def model(request) -> tuple[dict, LLM]:
    """(oracle data, fp32 LLM) for each model."""
    return _load(request, request.param)


@pytest.fixture(scope="module")
def oracle(model) -> dict:
    return model[0]


@pytest.fixture(scope="module")
def llm(model) -> LLM:
    return model[1]


def _argmax(dist: dict[int, float]) -> int:
    return max(dist, key=dist.get)


def test_tokenization_exact(oracle, llm):
    # add_bos=True asks for the file's own choice: SmolLM2's file turns BOS off.
    for case in oracle["tokenize"]:
        assert llm.tokenizer.encode(case["text"], add_bos=True) == case["ids"], case["text"]


def test_greedy_path_agreement(oracle, llm):
    prompts = [g["prompt_ids"] + g["output_ids"] for g in oracle["greedy"]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=5))
    agree = total = 0
    for g, out in zip(oracle["greedy"], outs):
        n_prompt = len(g["prompt_ids"])
        for i, ref in enumerate(g["top5_logprobs"]):
            if ref[0][1] - ref[1][1] < 0.3:
                continue
            total += 1
            agree += _argmax(out.prompt_logprobs[n_prompt + i]) == ref[0][0]
    assert total >= 100
    assert agree / total >= 0.97, f"greedy agreement {agree}/{total}"


def test_free_running_greedy_first_token(oracle, llm):
    outs = llm.generate([g["prompt_ids"] for g in oracle["greedy"]], SamplingParams(max_tokens=8, temperature=0.0))
    for g, out in zip(oracle["greedy"], outs):
        assert out.token_ids[0] == g["output_ids"][0], g["prompt"]


def _teacher_forced(oracle: dict, llm: LLM) -> tuple[int, int, float]:
    """(top-1 agreements, positions, mean |dlogprob| of the reference top-1) at margin >= 0.5."""
    case = oracle["teacher_forced"][0]
    ids = case["ids"]
    assert len(ids) > (1024 if "gemma3" in oracle["model"].lower() else 300)  # Gemma: past its 512-token window
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=20))[0]
    agree = total = 0
    errors = []
    skip = oracle.get("teacher_skip", 0)  # the README: positions whose reference is unstable
    for i, ref in enumerate(case["top5_logprobs"]):
        if i < skip or ref[0][1] - ref[1][1] < 0.5:
            continue
        mine = out.prompt_logprobs[i + 1]
        total += 1
        agree += _argmax(mine) == ref[0][0]
        errors.append(abs(mine.get(ref[0][0], -100.0) - ref[0][1]))
    mean_err = sum(errors) / len(errors)
    print(f"teacher-forced: top-1 agreement {agree}/{total}, mean |dlogprob| {mean_err:.4f} nats")
    return agree, total, mean_err


def test_teacher_forced_agreement_and_logprob_error(oracle, llm):
    agree, total, mean_err = _teacher_forced(oracle, llm)
    assert total >= 200
    assert agree / total >= 0.99
    assert mean_err <= 0.05


@pytest.mark.parametrize("name", MODELS[:2])
def test_int8_kv_cache_teacher_forced(request, name):
    """kv_cache_dtype int8 (per-token, per-head scales) with fp32 compute, through the C attention.
    Measured: Gemma 3 1096/1096 and 0.0077 nats, SmolLM2 1106/1106 and 0.0081 (fp16 KV: 0.0050
    and 0.0068)."""
    oracle, llm = _load(request, name, kv_cache_dtype="int8")
    assert llm.engine.worker.runner.kv_caches[0].k.dtype == torch.int8
    agree, total, mean_err = _teacher_forced(oracle, llm)
    assert total >= 1000
    assert agree / total >= 0.98
    assert mean_err <= 0.15


def test_fp16_kv_cache_teacher_forced(request):
    """kv_cache_dtype float16 with fp32 compute (llama.cpp's default KV type; the C attention
    reads it in place). Measured: SmolLM2 1106/1106 at 0.0077 nats."""
    oracle, llm = _load(request, "smollm2_135m_instruct", kv_cache_dtype="float16")
    assert llm.engine.worker.runner.kv_caches[0].k.dtype == torch.float16
    agree, total, mean_err = _teacher_forced(oracle, llm)
    assert total >= 1000
    assert agree / total >= 0.99
    assert mean_err <= 0.05


def test_bf16_packed_kernels_and_int4_head_teacher_forced(request, monkeypatch):
    """bf16 compute with the CPU's packed kernels at every row count (what decoding runs; a long
    prompt alone would take the dense ones): int4 where the file is 4-bit, int8 elsewhere, and
    Gemma 3's 262k-row output projection requantized to int4. Measured 1093/1096, 0.018 nats."""
    monkeypatch.setenv(kernel_choice.KERNEL_ENV, "packed")
    oracle = json.loads((ORACLE_DIR / "gemma3_270m.json").read_text())
    llm = LLM(str(request.getfixturevalue("embedded_model_path")), device="cpu", dtype="bfloat16", kv_cache_blocks=512)
    assert isinstance(llm.engine.worker.model.head.packed, Int4Weight)
    agree, total, mean_err = _teacher_forced(oracle, llm)
    assert total >= 1000
    assert agree / total >= 0.99
    assert mean_err <= 0.05


def _same_or_near_tie(alone, other) -> None:
    """Greedy tokens equal; where they first differ, the single run's top-2 margin is < 0.01."""
    for j, (a, b) in enumerate(zip(alone.token_ids, other.token_ids)):
        if a != b:
            top2 = sorted(alone.logprobs[j].values(), reverse=True)[:2]
            assert top2[0] - top2[1] < 0.01, f"token {j} differs ({a} vs {b}) with margin {top2[0] - top2[1]:.4f}"
            return


def _alone_and_together(oracle, llm) -> tuple[list, list[list]]:
    """Greedy runs of the oracle's prompts one at a time, and the same prompts packed and batched,
    chunked by a 16-token budget, and from the prefix cache."""
    long = oracle["teacher_forced"][0]["ids"]
    prompts = [g["prompt_ids"] for g in oracle["greedy"]] + [long[:40], long[:75], long[:150]]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
    sched = llm.engine.scheduler.config
    llm.engine.block_manager.enable_prefix_caching = False
    try:
        alone = [llm.generate([p], params)[0] for p in prompts]
        together = llm.generate(prompts, params)  # packed prefill, batched decode
        sched.max_num_batched_tokens = 16
        chunked = llm.generate(prompts, params)  # chunked prefill
    finally:
        sched.max_num_batched_tokens = 512
        llm.engine.block_manager.enable_prefix_caching = True
    llm.generate(prompts, params)  # fills the prefix cache
    hits = llm.engine.block_manager.num_hit_tokens
    cached = llm.generate(prompts, params)
    assert llm.engine.block_manager.num_hit_tokens > hits
    return alone, [together, chunked, cached]


def test_batched_chunked_cached_equal_alone(oracle, llm):
    """Near ties aside on the dense paths; bit for bit where the C kernels serve (each row is
    computed alone there)."""
    from app.kernels import cpu_qgemm

    alone, runs = _alone_and_together(oracle, llm)
    exact = isinstance(llm.engine.worker.model.head.packed, (cpu_qgemm.Q4Weight, cpu_qgemm.Q8Weight))
    for run in runs:
        if exact:
            assert [(o.token_ids, o.logprobs) for o in run] == [(o.token_ids, o.logprobs) for o in alone]
        for a, b in zip(alone, run):
            _same_or_near_tie(a, b)


@pytest.mark.parametrize("name", MODELS[:2])
def test_cpu_quantized_kernels_teacher_forced_and_resident_weights(request, monkeypatch, name):
    """fp32 compute's default where the C kernels build: 4/5/8-bit weight groups with llama.cpp's
    8-bit activations, at every row count. Held to the fp32 rule, the weights to 1.5x the file, and batched, chunked
    and cached runs to the single run bit for bit: every kernel on this path computes a row alone.
    Measured (with `auto`'s fp16 KV cache): Gemma 3 1096/1096, 0.0054 nats; SmolLM2 1106/1106, 0.0074."""
    from app.kernels import cpu_qgemm

    if cpu_qgemm._library() is None:
        pytest.skip("no C compiler or no AVX2/FMA/F16C here: the C kernels cannot build")
    monkeypatch.setenv(cpu_qgemm.ENABLE_ENV, "1")
    oracle, llm = _load(request, name)
    model = llm.engine.worker.model
    assert isinstance(model.head.packed, cpu_qgemm.Q8Weight) and model.embed_rows is model.head.packed
    path = _model_path(request, name)
    assert model.resident_weight_bytes() <= 1.5 * Path(path).stat().st_size
    agree, total, mean_err = _teacher_forced(oracle, llm)
    assert total >= 1000
    assert agree / total >= 0.99
    assert mean_err <= 0.05
    alone, runs = _alone_and_together(oracle, llm)
    for run in runs:
        assert [(o.token_ids, o.logprobs) for o in run] == [(o.token_ids, o.logprobs) for o in alone]


def test_fp16_weights_when_the_quantized_kernels_are_off(request, monkeypatch):
    """LOCALBATCH_CPU_QUANT_KERNELS=0: fbgemm's fp16 copies instead. Measured: Gemma 3 1096/1096,
    0.0047 nats (fp16 KV cache)."""
    from app.engine.runtime.weight_forms import Fp16Weight
    from app.kernels import cpu_qgemm

    monkeypatch.setenv(cpu_qgemm.ENABLE_ENV, "0")
    oracle, llm = _load(request, "gemma3_270m")
    if not isinstance(llm.engine.worker.model.layers[0].qkv.dense, Fp16Weight):
        pytest.skip("no fbgemm fp16 kernel, or bf16 compute here: the fp16 copies are not used")
    agree, total, mean_err = _teacher_forced(oracle, llm)
    assert total >= 1000
    assert agree / total >= 0.99
    assert mean_err <= 0.05
