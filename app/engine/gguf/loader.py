"""Load a GGUF file into a ready model: hyper-parameters, weights (dequantized, or the matrices as
their blocks for the C kernels), tokenizer.

Every problem with the file surfaces as one `GGUFError` line naming the file and what is wrong.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from app.engine.gguf.model_config import ModelConfig
from app.engine.gguf.quants import SUPPORTED_TYPES, BlockTensor, GridForm, dequantize
from app.engine.gguf.reader import GGUFFile
from app.engine.types.errors import GGUFError
from app.engine.types.progress import ProgressFn


@dataclass
class LoadedModel:
    path: Path
    config: ModelConfig
    # With load_gguf(grids=True) the matrices are `BlockTensor`s (their forms are built from the blocks).
    weights: dict[str, torch.Tensor | BlockTensor]
    metadata: dict[str, Any]
    # Tensors' 4/5-bit groups by name; the blocks carry their own, so the loader leaves it empty.
    grids: dict[str, GridForm] = field(default_factory=dict)


def expected_shapes(cfg: ModelConfig, vocab: int) -> dict[str, tuple[int, ...]]:
    """Every tensor the network needs, with its [out, in] shape; optional ones are added by the caller."""
    h, hd, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,)}
    for n in range(cfg.num_layers):
        p = f"blk.{n}."
        layer = {
            "attn_norm.weight": (h,),
            "attn_q.weight": (q, h),
            "attn_k.weight": (kv, h),
            "attn_v.weight": (kv, h),
            "attn_output.weight": (h, q),
            "ffn_norm.weight": (h,),
            "ffn_gate.weight": (i, h),
            "ffn_up.weight": (i, h),
            "ffn_down.weight": (h, i),
        }
        if cfg.attn_bias:
            layer.update({"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)})
        if cfg.qk_norm:
            layer.update({"attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,)})
        if cfg.post_norms:
            layer.update({"post_attention_norm.weight": (h,), "post_ffw_norm.weight": (h,)})
        shapes.update({p + k: v for k, v in layer.items()})
    return shapes


def load_gguf(
    path: str | os.PathLike,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: ProgressFn | None = None,
    grids: bool = False,
) -> LoadedModel:
    """`grids`: the matrices are for the CPU's C kernels, which take them from their blocks: each is
    handed out as a `BlockTensor` over the file (decoded when its form is built) instead of an fp32
    copy made here."""
    path = Path(path)
    with GGUFFile(path) as f:
        md = f.metadata
        embd = f.tensors.get("token_embd.weight")
        if embd is None:
            raise GGUFError(f"{path}: required tensor token_embd.weight is missing")
        try:
            cfg = ModelConfig.from_metadata(md, vocab_size=embd.shape[0])
        except GGUFError as e:
            raise GGUFError(f"{path}: {e}") from None
        shapes = expected_shapes(cfg, cfg.vocab_size)
        for optional in ("output.weight",):
            if optional in f.tensors:
                shapes[optional] = (cfg.vocab_size, cfg.hidden_size)
        _check_tensors(path, f, shapes)
        weights: dict[str, torch.Tensor | BlockTensor] = {}
        for n, name in enumerate(shapes):
            info = f.tensors[name]
            # Norm weights stay fp32: rms_norm runs in fp32 anyway.
            target = torch.float32 if "norm" in name else dtype
            if grids and len(info.shape) == 2 and torch.device(device).type == "cpu":
                weights[name] = BlockTensor(f.raw(name), info.ggml_type, info.shape, target, name=name)
            else:
                weights[name] = dequantize(f.raw(name), info.ggml_type, info.shape, dtype=target, name=name).to(device)
            if progress is not None:
                progress("loading tensors", (n + 1) / len(shapes))
        return LoadedModel(path=path, config=cfg, weights=weights, metadata=md)


def _check_tensors(path: Path, f: GGUFFile, shapes: dict[str, tuple[int, ...]]) -> None:
    for name, shape in shapes.items():
        info = f.tensors.get(name)
        if info is None:
            raise GGUFError(f"{path}: required tensor {name} is missing")
        if tuple(info.shape) != shape:
            raise GGUFError(f"{path}: tensor {name} has shape {tuple(info.shape)}, expected {shape}")
        if info.ggml_type not in SUPPORTED_TYPES:
            # dequantize() words this one with the supported list.
            dequantize(f.raw(name), info.ggml_type, info.shape, name=name)
