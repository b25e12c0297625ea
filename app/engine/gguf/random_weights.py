"""Real model shapes with random weights, for benchmarks without a model file
(`localbatch bench --random-weights qwen3:0.6b`)."""

from __future__ import annotations

import math

import torch

from app.engine.gguf.loader import expected_shapes
from app.engine.gguf.model_config import ModelConfig
from app.engine.types.errors import LocalbatchError

# Hyper-parameters of the published checkpoints (their HF configs).
PRESETS: dict[str, dict] = {
    "qwen3:0.6b": dict(arch="qwen3", hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                       intermediate_size=3072, vocab_size=151936, rope_theta=1e6, qk_norm=True),
    "qwen3:8b": dict(arch="qwen3", hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                     intermediate_size=12288, vocab_size=151936, rope_theta=1e6, qk_norm=True),
    "llama:1b": dict(arch="llama", hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                     intermediate_size=8192, vocab_size=128256, rope_theta=5e5),
    "llama:8b": dict(arch="llama", hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                     intermediate_size=14336, vocab_size=128256, rope_theta=5e5),
    "gemma3:270m": dict(arch="gemma3", hidden_size=640, num_layers=18, num_heads=4, num_kv_heads=1, head_dim=256,
                        intermediate_size=2048, vocab_size=262144, rope_theta=1e6, qk_norm=True),
}


def random_model(spec: str, device: torch.device, dtype: torch.dtype, max_position: int = 8192) -> tuple[ModelConfig, dict]:
    if spec not in PRESETS:
        raise LocalbatchError(f"unknown --random-weights {spec!r} (choose from {', '.join(PRESETS)})")
    p = dict(PRESETS[spec])
    arch = p["arch"]
    extra = {}
    if arch == "gemma3":
        extra = dict(hidden_act="gelu_tanh", embed_scale=math.sqrt(p["hidden_size"]), post_norms=True,
                     sliding_window=512, sliding_window_pattern=6, rope_theta_local=10000.0)
    cfg = ModelConfig(
        name=f"random-{spec}", rms_norm_eps=1e-6, max_position=max_position,
        rope_style="normal" if arch == "llama" else "neox", attn_scale=1.0 / math.sqrt(p["head_dim"]),
        **p, **extra,
    )
    gen = torch.Generator(device=device).manual_seed(0)
    weights = {}
    for name, shape in expected_shapes(cfg, cfg.vocab_size).items():
        if len(shape) == 1:
            weights[name] = torch.ones(shape, dtype=torch.float32, device=device)
        else:
            w = torch.empty(shape, dtype=dtype, device=device)
            weights[name] = w.normal_(0.0, 1.0 / math.sqrt(shape[1]), generator=gen)
    return cfg, weights
