"""The kernels a model runs are chosen once, when it is built (`runtime/kernel_plan.py`), and the
engine says which."""

from __future__ import annotations

import pytest
import torch

from app.engine.core.llm_engine import LLMEngine
from app.engine.runtime.kernel_plan import Attention, KernelPlan, RowOps
from app.engine.runtime.kv_pool import allocate_kv_caches
from app.kernels import cpu_forward, cpu_qgemm

needs_c = pytest.mark.skipif(cpu_forward._library() is None, reason="no C compiler or no AVX2/FMA/F16C here")


@needs_c
@pytest.mark.parametrize("kv_cache_dtype,stored", [("auto", torch.float16), ("int8", torch.int8)])
def test_fp32_on_a_cpu_runs_everything_in_c_in_one_call(kv_cache_dtype, stored, tiny_gguf_factory) -> None:
    engine = LLMEngine(str(tiny_gguf_factory("llama")), device="cpu", dtype="float32", kv_cache_blocks=64,
                       kv_cache_dtype=kv_cache_dtype)
    plan = engine.worker.model.plan
    assert (plan.rows, plan.attention, plan.one_call, plan.kv_dtype) == (RowOps.C, Attention.C, True, stored)
    assert engine.worker.backend == f"C kernels ({cpu_qgemm.isa()})"


@needs_c
def test_a_bf16_kv_cache_keeps_the_c_rows_and_says_why_attention_is_torch(tiny_gguf_factory) -> None:
    engine = LLMEngine(str(tiny_gguf_factory("llama")), device="cpu", dtype="float32", kv_cache_blocks=64,
                       kv_cache_dtype="bfloat16")
    plan = engine.worker.model.plan
    assert (plan.rows, plan.attention, plan.one_call) == (RowOps.C, Attention.TORCH, False)
    assert plan.unified_attention is not None and plan.store_kv is not None  # the torch reference's, named
    assert engine.worker.backend == (f"C kernels ({cpu_qgemm.isa()}); attention in torch "
                              "(the C attention reads fp32, fp16 or int8 KV caches, not bfloat16)")


def test_bf16_compute_runs_torch_throughout(tiny_gguf_factory) -> None:
    engine = LLMEngine(str(tiny_gguf_factory("llama")), device="cpu", dtype="bfloat16", kv_cache_blocks=64)
    assert engine.worker.model.plan == KernelPlan(RowOps.TORCH, Attention.TORCH, kv_dtype=torch.bfloat16)
    assert engine.worker.backend == "torch kernels: bfloat16 compute"


def test_a_pool_of_another_dtype_than_the_plan_is_refused_not_run(tiny_gguf_factory) -> None:
    engine = LLMEngine(str(tiny_gguf_factory("llama")), device="cpu", dtype="float32", kv_cache_blocks=64)
    model = engine.worker.model
    wrong = allocate_kv_caches(model.cfg, 4, 16, torch.int8, torch.device("cpu"))
    with pytest.raises(ValueError, match="int8 KV cache given to a model built for torch.float16"):
        model.hidden_states(torch.tensor([1]), torch.tensor([0]), None, wrong)


def test_what_a_model_leaves_to_torch_is_named() -> None:
    c = "C kernels (AVX2)"
    assert KernelPlan(RowOps.C, Attention.C, True).describe(c) == c
    assert KernelPlan("c", "c") == KernelPlan(RowOps.C, Attention.C)  # the names still read as the enums
    assert KernelPlan("torch", "torch").describe(c) == f"{c}; row ops and attention in torch (this model's sizes)"
    assert KernelPlan("c", "torch", kv_dtype=torch.float16).describe(c) == f"{c}; attention in torch (this model's sizes)"
    assert KernelPlan("torch", "torch").describe("torch kernels: no C compiler found") == "torch kernels: no C compiler found"
