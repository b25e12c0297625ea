"""Which kernels a model's forward runs, chosen once when the model is built by the registry
(`app/kernels/registry.py`): from the device, the compute and KV cache dtypes, the model's shapes,
what the C library built here and the settings read once then. The decoder then calls what was
chosen without asking again per call or per step. `weight_plan` says, from a GGUF's header alone,
which form each of its matrices takes (what `localbatch doctor` prints and the tests pin)."""

from __future__ import annotations

import enum
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from app.engine.gguf.model_config import ModelConfig
from app.engine.gguf.reader import GGUFFile
from app.engine.runtime.weight_forms import Source, TypedMatrix, fused, takes_groups
from app.kernels import attention_kernels, registry
from app.kernels.registry import AttentionRequest, EmbeddingRequest, RowRequest, WeightRequest
from app.kernels.settings import ENV_VARS, KernelSettings

# Each layer's matrices, fused by rows so a layer makes three matmuls instead of six (`DecoderLayer`).
LAYER_MATRICES = {"qkv": ("attn_q.weight", "attn_k.weight", "attn_v.weight"), "o_proj": ("attn_output.weight",),
                  "gate_up": ("ffn_gate.weight", "ffn_up.weight"), "down": ("ffn_down.weight",)}
# From this vocabulary size on, the bf16 CPU path's output projection is requantized to int4: it is
# then most of the bytes a decode step reads, and a small head gains little and loses more accuracy
# (figures: docs/benchmarks.md, "Figures behind constants").
INT4_HEAD_MIN_VOCAB = 131072
GROUP_FORMS = ("q4k", "q4", "q5", "q6", "split", "q8")  # the registry's `weight` entries: the C kernels' groups


class RowOps(str, enum.Enum):
    """Who runs the row ops: RMS norm, the residual add with it, the MLP's activation."""

    C = "c"  # cpu_ops
    TORCH = "torch"


class Attention(str, enum.Enum):
    """Who runs RoPE, the KV store and paged attention."""

    C = "c"  # cpu_attention's fused calls
    TRITON = "triton"
    TORCH = "torch"  # the reference


@dataclass(frozen=True)
class KernelPlan:
    rows: RowOps
    attention: Attention
    one_call: bool = False  # every layer in one C call (cpu_forward); set by the decoder, which has the weights
    kv_dtype: torch.dtype = torch.float32
    settings: KernelSettings = field(default_factory=KernelSettings, compare=False)  # as read when planned
    why_torch: str | None = field(default=None, compare=False)  # the registry's reason the C kernels passed
    # A TRITON or TORCH attention's kernels, filled in from `attention` (C has its own fused calls).
    unified_attention: Callable | None = field(default=None, compare=False)
    store_kv: Callable | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", RowOps(self.rows))
        object.__setattr__(self, "attention", Attention(self.attention))
        if self.attention is not Attention.C and self.unified_attention is None:
            unified_attention, store_kv = attention_kernels(self.attention.value)
            object.__setattr__(self, "unified_attention", unified_attention)
            object.__setattr__(self, "store_kv", store_kv)

    def describe(self, backend: str) -> str:
        """`backend` (the device's choice, e.g. "C kernels (AVX2)") with what this model's shapes or
        KV cache left to torch."""
        if not backend.startswith("C kernels") or (self.rows is RowOps.C and self.attention is Attention.C):
            return backend
        left = " and ".join(name for name, ours in (("row ops", self.rows is RowOps.C),
                                                    ("attention", self.attention is Attention.C)) if not ours)
        why = self.why_torch or "this model's sizes"
        return f"{backend}; {left} in torch ({why})"


def plan_kernels(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, kv_dtype: torch.dtype,
                 settings: KernelSettings | None = None) -> KernelPlan:
    """The rows and attention kernels for this model (`one_call` is the decoder's to add)."""
    settings = settings or KernelSettings.from_env()
    requests = {"row_ops": row_request(cfg, dtype, device),
                "attention": attention_request(cfg, dtype, device, kv_dtype, settings)}
    chosen = {op: registry.choose(op, request).name for op, request in requests.items()}
    why = [dict((e.name, reason) for e, reason in registry.verdicts(op, request))["c"]
           for op, request in requests.items() if chosen[op] != "c"]
    return KernelPlan(chosen["row_ops"], chosen["attention"], kv_dtype=kv_dtype, settings=settings,
                      why_torch="; ".join(why) or None)


def row_request(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> RowRequest:
    widths = (cfg.hidden_size, cfg.intermediate_size) + ((cfg.head_dim,) if cfg.qk_norm else ())
    return RowRequest(device.type, dtype, widths, cfg.hidden_act)


def attention_request(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, kv_dtype: torch.dtype,
                      settings: KernelSettings) -> AttentionRequest:
    """A model's attention block: paged attention, the KV store and the fused RoPE pass."""
    return AttentionRequest(device.type, dtype, kv_dtype, cfg.num_heads, cfg.head_dim, rope=True, settings=settings)


def weight_plan(path: str | os.PathLike, dtype: torch.dtype = torch.float32, settings: KernelSettings | None = None,
                device: torch.device = torch.device("cpu")) -> dict[str, str]:
    """Which registry entry each matrix of the GGUF at `path` takes on `device` with `dtype` compute,
    from its header alone (no block is read): {"blk.N.qkv": "split(q4k+q6)", ..., "output": "q6",
    "token_embd": "head"}. A packed copy for few rows ("tensor+int8") is kept only up to the
    crossover measured at load; "fp16" tables assume values in fp16's range."""
    settings = settings or KernelSettings.from_env()
    types, cfg = _header(path)
    blocks = takes_groups(device, dtype, settings)  # else the loader dequantizes: no grids

    def matrix(name: str) -> TypedMatrix:
        return TypedMatrix(*types[name], dtype=dtype, blocks=blocks, device=device)

    plan = {f"blk.{i}.{kind}": matrix_plan(fused([matrix(f"blk.{i}.{n}") for n in names]), settings)
            for i in range(cfg.num_layers) for kind, names in LAYER_MATRICES.items()}
    tied = "output.weight" not in types
    head = plan["output"] = matrix_plan(matrix("token_embd.weight" if tied else "output.weight"), settings,
                                        requantize_int4=cfg.vocab_size >= INT4_HEAD_MIN_VOCAB)
    request = EmbeddingRequest(_HeaderSource(matrix("token_embd.weight")), tied, head.startswith("tensor"),
                               head.split("(")[0] in GROUP_FORMS)
    plan["token_embd"] = registry.choose("embedding", request).name
    return plan


def matrix_plan(matrix, settings: KernelSettings, requantize_int4: bool = False) -> str:
    """The registry's choice for one matrix: a group form ("split(q4k+q6)" names its runs' forms), else
    the many-rows form with the few-rows candidate ("fp16", "tensor+int8")."""
    request = WeightRequest(Source(matrix), settings, requantize_int4=requantize_int4)
    groups = registry.choose("weight", request)
    if groups is not None and groups.name == "split":
        return "split(" + "+".join(registry.choose("weight", request.part(run)).name for run in request.source.runs()) + ")"
    if groups is not None:
        return groups.name
    few = registry.choose("weight_few_rows", request)
    many = registry.choose("weight_many_rows", request).name
    return many if few is None else f"{many}+{few.name}"


def summarize(plan: dict[str, str]) -> str:
    """A weight plan in a line: each form with its count of layer matrices, then the head and table."""
    counts = Counter(v for k, v in plan.items() if k.startswith("blk."))
    layers = ", ".join(f"{form} x{n}" for form, n in counts.most_common())
    return f"{layers}; output {plan['output']}; token table {plan['token_embd']}"


class _HeaderSource(Source):
    def fits_fp16(self) -> bool:
        return True  # not read from a header: an fp16 copy where the values fit, else fp32


def _header(path: str | os.PathLike) -> tuple[dict[str, tuple[int, tuple[int, ...]]], ModelConfig]:
    with GGUFFile(path) as f:
        types = {name: (info.ggml_type, info.shape) for name, info in f.tensors.items()}
        return types, ModelConfig.from_metadata(f.metadata, vocab_size=types["token_embd.weight"][1][0])


def doctor_plan(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, models: dict[str, os.PathLike]
                ) -> list[tuple[str, str]]:
    """`localbatch doctor`'s rows: the settings read, then for each model what the registry chooses
    on this machine (each op's choice, with why the entries before it passed)."""
    settings = KernelSettings.from_env()
    rows = [("settings", f"{settings.describe()} (of {', '.join(ENV_VARS)})")]
    for name, path in models.items():
        cfg = _header(path)[1]
        ops = (("attention", attention_request(cfg, dtype, device, kv_dtype, settings)),
               ("row ops", row_request(cfg, dtype, device)))
        chosen = " · ".join(f"{label} {_choice(label.replace(' ', '_'), request)}" for label, request in ops)
        key = "plan" if len(rows) == 1 else ""
        rows.append((key, f"{name}: {chosen} · {summarize(weight_plan(path, dtype, settings, device))}"))
    return rows


def _choice(op: str, request: object) -> str:
    passed = []
    for entry, why in registry.verdicts(op, request):
        if why is None:
            return entry.name + (f" ({'; '.join(passed)})" if passed else "")
        passed.append(f"not {entry.name}: {why}")
    return "none"
