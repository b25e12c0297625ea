"""The registry's plan for each catalog model's weights and for the tiny test GGUFs, pinned: with
the C kernels (fp32 compute on a CPU that builds them) every matrix takes the form it took before
the registry, read from the GGUF headers alone (`kernel_plan.weight_plan`); for the tiny files the
plan is also held against the forms a built model holds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from app.engine.gguf.catalog import installed_path
from app.engine.gguf.loader import load_gguf
from app.engine.gguf.quants import SUPPORTED_TYPES, BlockTensor
from app.engine.runtime.decoder import DecoderLM
from app.engine.runtime.kernel_plan import doctor_plan, weight_plan
from app.engine.runtime.weight_forms import TypedMatrix
from app.kernels import cpu_attention, cpu_build, cpu_ops, cpu_qgemm, registry
from app.kernels.registry import AttentionRequest, RowRequest
from app.kernels.settings import KernelSettings

needs_gemm = pytest.mark.skipif(cpu_qgemm.library() is None,
                                reason="the C GEMM does not build here (no C compiler, or no AVX2/FMA/F16C)")
DEFAULTS = KernelSettings()  # the C kernels wherever they build


def _layers(spec: str, n: int) -> list[str]:
    """"q4k x28", or one form per layer."""
    if " x" in spec and spec.count(" ") == 1:
        form, count = spec.split(" x")
        assert int(count) == n
        return [form] * n
    forms = spec.split()
    assert len(forms) == n
    return forms


# name: (layers, {kind: forms}, output projection, token table)
CATALOG_PLANS = {
    "qwen2.5-coder-1.5b-instruct": (28, {
        "qkv": "split(q4k+q6) split(q4k+q6) q4k q4k q4k split(q4k+q6) split(q4k+q6) split(q4k+q6) split(q4k+q6) "
               "split(q4k+q6) split(q4k+q6) q4k q4k split(q4k+q6) q4k q4k split(q4k+q6) q4k q4k split(q4k+q6) q4k "
               "split(q4k+q6) q4k q4k split(q4k+q6) q4k q4k split(q4k+q6)",
        "o_proj": "q4k x28", "gate_up": "q4k x28",
        "down": "q6 q6 q4k q4k q4k q6 q6 q6 q6 q6 q6 q4k q4k q6 q4k q4k q6 q4k q4k q6 q4k q6 q4k q4k q6 q4k q4k q6",
    }, "q6", "q4k"),
    "qwen2.5-coder-0.5b-instruct": (24, {
        "qkv": "split(q5+q8) split(q5+q8) q5 split(q5+q8) q5 q5 split(q5+q8) split(q5+q8) split(q5+q8) split(q5+q8) "
               "split(q5+q8) q5 q5 split(q5+q8) q5 q5 split(q5+q8) q5 q5 split(q5+q8) q5 split(q5+q8) q5 q5",
        "o_proj": "q5 x24", "gate_up": "q5 x24",
        "down": "q6 q6 q4k q6 q4k q4k q6 q6 q6 q6 q6 q4k q4k q6 q4k q4k q6 q4k q4k q6 q4k q6 q4k q4k",
    }, "q8", "q5"),
    "smollm2-135m-instruct": (30, {"qkv": "q4 x30", "o_proj": "q4 x30", "gate_up": "q4 x30", "down": "q4 x30"},
                              "q8", "head"),
    "gemma3-270m": (18, {
        "qkv": "split(q5+q8) split(q5+q8) q5 q5 split(q5+q8) q5 q5 split(q5+q8) q5 q5 split(q5+q8) q5 q5 "
               "split(q5+q8) q5 split(q5+q8) split(q5+q8) split(q5+q8)",
        "o_proj": "q4k x18", "gate_up": "q5 x18",
        "down": "q6 q6 q4k q4k q6 q4k q4k q6 q4k q4k q6 q4k q4k q6 q4k q6 q6 q6",
    }, "q8", "head"),
}

# (arch, writer arguments): (layers, output projection, token table); every layer matrix q8
TINY_PLANS = {
    ("llama", ()): (2, "q8", "fp16"),
    ("gemma3", ()): (7, "q8", "head"),
    ("qwen3", ()): (2, "q8", "head"),
    ("qwen3", (("weight_type", "Q8_0"),)): (2, "q8", "head"),
    ("qwen2", ()): (2, "q8", "fp16"),
    ("qwen2", (("weight_type", "Q8_0"),)): (2, "q8", "fp16"),
    ("qwen2", (("weight_type", "F16"),)): (2, "q8", "fp16"),
    ("qwen2", (("weight_type", "BF16"),)): (2, "q8", "fp16"),
    ("qwen2", (("tie_word_embeddings", True),)): (2, "q8", "head"),
}


def _expected(layers: int, kinds: dict[str, str], output: str, table: str) -> dict[str, str]:
    plan = {f"blk.{i}.{kind}": form for kind, spec in kinds.items() for i, form in enumerate(_layers(spec, layers))}
    return dict(sorted(plan.items()), output=output, token_embd=table)


def _catalog_path(name: str, request: pytest.FixtureRequest):
    if name == "gemma3-270m":  # embedded in the package: assembled, never downloaded
        return request.getfixturevalue("embedded_model_path")
    path = installed_path(name)
    if path is None:
        pytest.skip(f"{name} is not pulled here (`localbatch pull {name}`)")
    return path


@needs_gemm
@pytest.mark.parametrize("name", list(CATALOG_PLANS))
def test_each_catalog_models_weights_take_their_pinned_forms(name: str, request: pytest.FixtureRequest) -> None:
    plan = weight_plan(_catalog_path(name, request), torch.float32, DEFAULTS)
    assert dict(sorted(plan.items())) == _expected(*CATALOG_PLANS[name])


@needs_gemm
@pytest.mark.parametrize("arch,kw", list(TINY_PLANS))
def test_the_tiny_files_plan_is_what_a_built_model_holds(arch: str, kw: tuple, tiny_gguf_factory) -> None:
    path = tiny_gguf_factory(arch, **dict(kw))
    layers, output, table = TINY_PLANS[(arch, kw)]
    plan = weight_plan(path, torch.float32, DEFAULTS)
    assert plan == _expected(layers, dict.fromkeys(("qkv", "o_proj", "gate_up", "down"), f"q8 x{layers}"), output, table)
    loaded = load_gguf(path, "cpu", torch.float32, grids=True)
    model = DecoderLM(loaded.config, loaded.weights, torch.device("cpu"), loaded.grids)
    held = {f"blk.{i}.{kind}": getattr(layer, kind).plan for i, layer in enumerate(model.layers)
            for kind in ("qkv", "o_proj", "gate_up", "down")}
    assert dict(held, output=model.head.plan, token_embd=model.embed_plan) == plan
    assert (model.embed_rows is model.head.packed) == (table == "head")


def test_without_the_c_kernels_or_with_dense_forced_every_matrix_says_so(tiny_gguf_factory) -> None:
    path = tiny_gguf_factory("qwen2")
    off = weight_plan(path, torch.float32, KernelSettings(quant_kernels=False))
    assert set(off.values()) == {"fp16"}  # fbgemm's copies; the untied table in fp16
    dense = weight_plan(path, torch.float32, KernelSettings(linear_kernel="dense"))
    assert set(dense.values()) - {"table"} == {"tensor"} and dense["token_embd"] == "table"
    bf16 = weight_plan(path, torch.bfloat16, DEFAULTS)
    assert set(v for k, v in bf16.items() if k != "token_embd") <= {"tensor+int4", "tensor"}
    assert bf16["token_embd"] == "table"


def test_built_forms_follow_the_settings_a_model_read(tiny_gguf_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALBATCH_CPU_QUANT_KERNELS", "0")
    path = tiny_gguf_factory("qwen2")
    loaded = load_gguf(path, "cpu", torch.float32)
    model = DecoderLM(loaded.config, loaded.weights, torch.device("cpu"))
    assert {lin.plan for layer in model.layers for lin in layer.linears()} == {"fp16"}
    assert model.embed_plan == "fp16" and model.plan.settings == KernelSettings(quant_kernels=False)


def test_a_header_knows_each_types_grid_as_its_blocks_do() -> None:
    """The plan reads a matrix's grid from its type; the file's blocks say the same."""
    for ggml_type in sorted(SUPPORTED_TYPES):
        qtype = GGMLQuantizationType(ggml_type)
        block, size = GGML_QUANT_SIZES[qtype]
        shape = (8, 256)
        blocks = BlockTensor(np.zeros(8 * 256 // block * size, dtype=np.uint8), ggml_type, shape)
        assert TypedMatrix(ggml_type, shape).grid_bits == blocks.grid_bits, qtype.name


def test_the_registry_lists_each_ops_entries_in_order() -> None:
    names = {op: [e.name for e in registry.entries(op)] for op in registry.OPS}
    assert names == {
        "attention": ["triton", "c", "torch"],
        "row_ops": ["c", "torch"],
        "weight": ["q4k", "q4", "q5", "q6", "split", "q8"],
        "weight_many_rows": ["fp16", "tensor"],
        "weight_few_rows": ["int4", "int8"],
        "embedding": ["table", "head", "q4k", "q4", "q5", "q6", "fp16", "fp32"],
    }
    assert all(e.doc for e in registry.ENTRIES)
    assert all(e.build is not None for e in registry.ENTRIES if e.op.startswith(("weight", "embedding")))
    with pytest.raises(ValueError, match="no op named 'gemm'"):
        registry.entries("gemm")


def test_the_doctor_prints_the_settings_and_each_models_plan(tiny_gguf_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALBATCH_CPU_ATTENTION", "torch")
    rows = doctor_plan(torch.device("cpu"), torch.float32, torch.float16, {"tiny": tiny_gguf_factory("qwen2")})
    assert rows[0] == ("settings", "LOCALBATCH_CPU_ATTENTION=torch (of LOCALBATCH_LINEAR_KERNEL, "
                                   "LOCALBATCH_CPU_QUANT_KERNELS, LOCALBATCH_CPU_ATTENTION, "
                                   "LOCALBATCH_CPU_ATTENTION_BF16, LOCALBATCH_CPU_ISA)")
    key, plan = rows[1]
    assert key == "plan" and plan.startswith("tiny: attention torch (not triton: CUDA only; not c: "
                                             "LOCALBATCH_CPU_ATTENTION=torch) · row ops ")
    if cpu_qgemm.library() is not None:
        assert plan.endswith(" · q8 x8; output q8; token table fp16")


def test_a_machine_without_the_c_library_plans_torch_and_says_why(tiny_gguf_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    """No C compiler, or a CPU without AVX2/FMA/F16C: every choice falls to torch's, named."""
    for module in (cpu_qgemm, cpu_attention, cpu_ops):
        monkeypatch.setattr(module, "library", lambda: None)
    monkeypatch.setattr(cpu_build, "library", lambda: cpu_build.KernelLibrary(None, "no C compiler found"))
    assert set(weight_plan(tiny_gguf_factory("qwen2"), torch.float32, DEFAULTS).values()) == {"fp16"}
    request = AttentionRequest("cpu", torch.float32, torch.float16, 4, 64, rope=True)
    assert [(e.name, why) for e, why in registry.verdicts("attention", request)] == [
        ("triton", "CUDA only"), ("c", "no C compiler found"), ("torch", None)]
    assert registry.choose("row_ops", RowRequest("cpu", torch.float32, (64, 128), "silu")).name == "torch"
