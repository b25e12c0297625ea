"""The embedded model against llama.cpp's reference data (../shared/oracle), by the tolerance rule
of its README, with fp32 compute."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from app.engine import LLM, SamplingParams

ORACLE = Path(os.environ.get("LOCALBATCH_ORACLE", Path(__file__).resolve().parents[2] / "shared" / "oracle" / "gemma3_270m.json"))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not ORACLE.exists(), reason=f"oracle data not found at {ORACLE} (set LOCALBATCH_ORACLE)"),
]


@pytest.fixture(scope="module")
def oracle() -> dict:
    return json.loads(ORACLE.read_text())


@pytest.fixture(scope="module")
def llm(embedded_model_path) -> LLM:
    return LLM(str(embedded_model_path), device="cpu", dtype="float32", kv_cache_blocks=512)


def _argmax(dist: dict[int, float]) -> int:
    return max(dist, key=dist.get)


def test_tokenization_exact(oracle, llm):
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
    assert total > 100
    assert agree / total >= 0.97, f"greedy agreement {agree}/{total}"


def test_free_running_greedy_first_token(oracle, llm):
    outs = llm.generate([g["prompt_ids"] for g in oracle["greedy"]], SamplingParams(max_tokens=8, temperature=0.0))
    for g, out in zip(oracle["greedy"], outs):
        assert out.token_ids[0] == g["output_ids"][0], g["prompt"]


def test_teacher_forced_agreement_and_logprob_error(oracle, llm):
    case = oracle["teacher_forced"][0]
    ids = case["ids"]
    assert len(ids) > 1024  # past the 512-token sliding window
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=20))[0]
    agree = total = 0
    errors = []
    for i, ref in enumerate(case["top5_logprobs"]):
        if ref[0][1] - ref[1][1] < 0.5:
            continue
        mine = out.prompt_logprobs[i + 1]
        total += 1
        agree += _argmax(mine) == ref[0][0]
        errors.append(abs(mine.get(ref[0][0], -100.0) - ref[0][1]))
    mean_err = sum(errors) / len(errors)
    print(f"teacher-forced: top-1 agreement {agree}/{total}, mean |dlogprob| {mean_err:.4f} nats")
    assert agree / total >= 0.99
    assert mean_err <= 0.05
