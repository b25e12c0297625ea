"""kv_cache_dtype on the engine: an int8 pool (per-token, per-head scales) keeps batch invariance,
prefix caching and preemption on the tiny fp32 fixtures, holds about twice the tokens of a bf16
pool in the same bytes, settings the device cannot run fail in one line, and what "auto" picks."""

from __future__ import annotations

import json

import pytest
import torch

from app.engine.runtime.kernel_choice import KERNEL_ENV
from app.engine.runtime.kv_pool import resolve_kv_cache_dtype
from app.engine.types.engine_config import EngineConfig
from app.engine.types.errors import LocalbatchError
from app.kernels import cpu_attention
from tests.engine.core.test_engine import PREEMPTING_POOL, make_engine, prompts, run_all, run_alone
from tests.engine.runtime.test_model import PagedRun, _ids
from tests.support.reference_model import ReferenceModel
from tests.test_cli import run_cli

INT8 = {"kv_cache_dtype": "int8"}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_int8_kv_forward_stays_close_to_reference(arch, tiny_gguf_factory, monkeypatch):
    """Packed prefill chunks, then decodes beside an idle sequence, over an int8 pool: within int8
    rounding of the plain fp32 reference forward (the weights as loaded, so only the pool rounds)."""
    monkeypatch.setenv(KERNEL_ENV, "dense")
    path = tiny_gguf_factory(arch)
    ref = ReferenceModel(path)
    run = PagedRun(path, kv_dtype=torch.int8)
    a = {"ids": _ids(23, run.model.cfg.vocab_size, 1), "done": 0, "table": []}
    b = {"ids": _ids(17, run.model.cfg.vocab_size, 2), "done": 0, "table": []}
    outs = [run.step([a, b], [9, 4]), run.step([a, b], [6, 13])]
    outs += [run.step([a, b], [1, 0]) for _ in range(8)]
    got = torch.cat([o[0] for o in outs])
    want = ref.forward(a["ids"])
    assert ((got - want).norm() / want.norm()).item() < 0.03  # measured 0.008 (llama), 0.015 (gemma3)


@pytest.fixture(scope="module")
def model_path(tiny_gguf_factory):
    return tiny_gguf_factory("gemma3")  # sliding window 8: long prompts cross it


@pytest.fixture(scope="module")
def reference(model_path):
    """Each of 6 prompts run alone over an int8 pool, prefix caching off."""
    engine = make_engine(model_path, enable_prefix_caching=False, **INT8)
    assert engine.worker.runner.kv_caches[0].k.dtype == torch.int8 and engine.worker.runner.kv_caches[0].quantized
    reqs = prompts(6)
    return reqs, run_alone(engine, reqs)


def test_int8_batched_and_chunked_equal_alone(model_path, reference):
    reqs, alone = reference
    assert run_all(make_engine(model_path, enable_prefix_caching=False, **INT8), reqs) == alone
    chunked = make_engine(model_path, max_num_batched_tokens=16, enable_prefix_caching=False, **INT8)
    assert run_all(chunked, reqs) == alone


def test_int8_prefix_cache_and_preemption(model_path, reference):
    reqs, alone = reference
    # The pool cannot hold 8 requests of up to 52 tokens: decodes preempt, and the recompute finds
    # its own blocks (int8 data and scales) still cached.
    engine = make_engine(model_path, kv_cache_blocks=PREEMPTING_POOL, **INT8)
    assert run_all(engine, reqs) == alone
    assert engine.scheduler.num_preemptions > 0 and engine.block_manager.hit_rate > 0
    # With room to keep them, a second run's prompts are served from the first run's int8 blocks.
    roomy = make_engine(model_path, **INT8)
    assert run_all(roomy, reqs[:2]) == alone[:2]
    assert run_all(roomy, reqs[:2]) == alone[:2]
    assert roomy.block_manager.num_hit_tokens > 0


def test_int8_pool_holds_about_twice_the_bf16_tokens(model_path):
    budget = 1 << 20
    engines = {name: make_engine(model_path, kv_cache_blocks=None, kv_cache_bytes=budget, kv_cache_dtype=name)
               for name in ("bfloat16", "int8")}
    cfg = engines["int8"].plan.model_config
    per_head = {"bfloat16": 2 * cfg.head_dim, "int8": cfg.head_dim + 4}  # data (+ fp32 scale)
    for name, engine in engines.items():
        assert engine.stats().kv_bytes_per_token == 2 * cfg.num_layers * cfg.num_kv_heads * per_head[name]
        # A pool block holds 4 tokens of one layer (one KV cache group of one layer).
        assert engine.stats().num_blocks_total == budget // (engine.plan.kv_bytes_per_token // cfg.num_layers * 4)
    ratio = engines["int8"].stats().num_blocks_total / engines["bfloat16"].stats().num_blocks_total
    assert ratio == pytest.approx(per_head["bfloat16"] / per_head["int8"], rel=0.02)  # 1.78 at head_dim 32; 1.97 at 256
    # A bf16 pool under fp32 compute serves too (stored rounded, attended in fp32).
    assert len(run_all(engines["bfloat16"], prompts(2, seed=3), max_tokens=4)[0]) == 4


def test_bench_reports_the_kv_cache(model_path):
    proc = run_cli("bench", "--model", str(model_path), "--num-prompts", "2", "--input-len", "8", "--output-len", "3",
                   "--kv-cache-dtype", "int8", "--kv-cache-blocks", "280", "--block-size", "4", "--json",
                   "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    # 280 blocks of 4 tokens, each of one layer of 7: 160 tokens in every layer.
    assert report["kv_cache_dtype"] == "int8" and report["kv_cache_tokens"] == 160


def test_fp8_on_cpu_is_refused_in_one_line(model_path):
    with pytest.raises(LocalbatchError, match=r"^kv_cache_dtype fp8_e4m3 needs CUDA; on CPU use int8$"):
        make_engine(model_path, kv_cache_dtype="fp8_e4m3")
    proc = run_cli("generate", "--model", str(model_path), "--prompt", "x", "--kv-cache-dtype", "fp8_e4m3",
                   "--device", "cpu")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == ["localbatch: error: kv_cache_dtype fp8_e4m3 needs CUDA; on CPU use int8"]


def test_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(LocalbatchError, match="invalid kv_cache_dtype='int4': choose auto, float32, bfloat16, float16, int8"):
        EngineConfig(kv_cache_dtype="int4").validate()


def test_auto_is_fp16_for_fp32_compute_on_a_cpu_with_the_c_attention(monkeypatch):
    """llama.cpp's default KV type where the C attention reads it; the compute dtype elsewhere."""
    cpu = torch.device("cpu")
    expected = torch.float16 if cpu_attention.available() else torch.float32
    assert resolve_kv_cache_dtype("auto", torch.float32, cpu) == expected
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, cpu) == torch.bfloat16
    monkeypatch.setenv(cpu_attention.BACKEND_ENV, "torch")
    assert resolve_kv_cache_dtype("auto", torch.float32, cpu) == torch.float32


def test_cpu_pool_is_sized_by_need_capped_by_the_budget(monkeypatch):
    """By default the CPU pool holds what every sequence at the full context can use, at most 25%
    of the available RAM; an explicit byte budget or block count is taken as given."""
    import torch

    from app.engine.runtime import device as dev
    from app.engine.types.engine_config import EngineConfig

    monkeypatch.setattr(dev, "available_ram_bytes", lambda: 4 * 1000 * 4096)
    setup = dev.DeviceSetup(torch.device("cpu"), torch.float32)
    per_token = 256  # a 4096-byte block of 16 tokens

    assert dev.kv_pool_blocks(EngineConfig(), setup, per_token, lambda: None, max_needed=300) == 300
    assert dev.kv_pool_blocks(EngineConfig(), setup, per_token, lambda: None, max_needed=5000) == 1000
    assert dev.kv_pool_blocks(EngineConfig(), setup, per_token, lambda: None) == 1000
    assert dev.kv_pool_blocks(EngineConfig(kv_cache_bytes=4096 * 2000), setup, per_token, lambda: None, max_needed=10) == 2000
    assert dev.kv_pool_blocks(EngineConfig(kv_cache_blocks=7), setup, per_token, lambda: None, max_needed=10) == 7
