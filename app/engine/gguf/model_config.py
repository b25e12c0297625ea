"""Model hyper-parameters, read from GGUF metadata with llama.cpp's meanings."""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from app.engine.types.errors import GGUFError

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")

# llama.cpp's converter permutes Llama's q/k weights so RoPE rotates adjacent pairs ("normal");
# the others keep HF's half-split layout ("neox").
_ROPE_STYLE = {"llama": "normal", "qwen2": "neox", "qwen3": "neox", "gemma3": "neox"}


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_style: str
    max_position: int
    rope_scaling_factor: float = 1.0  # linear position scaling (Gemma 3's global layers)
    rope_theta_local: float | None = None  # Gemma 3's sliding-window layers use their own base
    sliding_window: int | None = None
    sliding_window_pattern: int = 0  # every Nth layer is global; 0: all layers share one kind
    qk_norm: bool = False
    attn_bias: bool = False
    hidden_act: str = "silu"
    embed_scale: float | None = None
    post_norms: bool = False
    attn_scale: float = 1.0

    def is_sliding(self, layer: int) -> bool:
        if self.sliding_window is None:
            return False
        return self.sliding_window_pattern == 0 or (layer + 1) % self.sliding_window_pattern != 0

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.is_sliding(layer) else None

    def kv_bytes_per_token(self, dtype_size: int, scale_bytes: int = 0) -> int:
        """K and V bytes of one token over all layers; a quantized cache adds `scale_bytes` per
        (KV head, K or V)."""
        return 2 * self.num_layers * self.num_kv_heads * (self.head_dim * dtype_size + scale_bytes)

    def kv_bytes_read(self, context_lens: Iterable[int], dtype_size: int, scale_bytes: int = 0) -> int:
        """Bytes of K and V one step's attention reads for sequences of these context lengths:
        each layer reads its window (sliding-window layers at most `sliding_window` tokens)."""
        per_layer_token = 2 * self.num_kv_heads * (self.head_dim * dtype_size + scale_bytes)
        return per_layer_token * sum(
            layers * min(ctx, window or ctx) for ctx in context_lens for window, layers in self.layer_windows
        )

    @functools.cached_property
    def layer_windows(self) -> tuple[tuple[int | None, int], ...]:
        """(window or None, how many layers have it): counted once, not on every step's
        `kv_bytes_read`."""
        return tuple(Counter(self.layer_window(i) for i in range(self.num_layers)).items())

    @classmethod
    def from_metadata(cls, md: dict[str, Any], vocab_size: int | None = None) -> "ModelConfig":
        arch = md.get("general.architecture")
        if arch not in SUPPORTED_ARCHS:
            raise GGUFError(
                f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})"
            )

        def get(key: str, default: Any = None, required: bool = True) -> Any:
            value = md.get(f"{arch}.{key}", default)
            if value is None and required:
                raise GGUFError(f"metadata key {arch}.{key} is missing")
            return value

        hidden = int(get("embedding_length"))
        heads = int(get("attention.head_count"))
        head_dim = int(get("attention.key_length", hidden // heads))
        tokens = md.get("tokenizer.ggml.tokens")
        vocab = vocab_size or int(get("vocab_size", len(tokens) if tokens is not None else None))
        common = dict(
            arch=arch,
            name=str(md.get("general.name") or arch),
            vocab_size=vocab,
            hidden_size=hidden,
            num_layers=int(get("block_count")),
            num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=head_dim,
            intermediate_size=int(get("feed_forward_length")),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_style=_ROPE_STYLE[arch],
            max_position=int(get("context_length")),
            attn_scale=1.0 / math.sqrt(head_dim),
        )
        if arch == "qwen2":
            common.update(attn_bias=True)
        elif arch == "qwen3":
            common.update(qk_norm=True)
        elif arch == "gemma3":
            scaling = get("rope.scaling.factor", 1.0, required=False)
            scaling_type = get("rope.scaling.type", "linear" if scaling != 1.0 else None, required=False)
            if scaling_type not in (None, "none", "linear"):
                raise GGUFError(f"unsupported RoPE scaling {scaling_type!r} for gemma3 (supported: linear)")
            # llama.cpp: Gemma 3 27B scales queries by hidden/heads, every other size by head_dim.
            if common["num_layers"] == 62:
                common["attn_scale"] = 1.0 / math.sqrt(hidden // heads)
            common.update(
                qk_norm=True,
                hidden_act="gelu_tanh",
                embed_scale=math.sqrt(hidden),
                post_norms=True,
                sliding_window=int(get("attention.sliding_window")),
                sliding_window_pattern=6,
                rope_theta_local=10000.0,
                rope_scaling_factor=float(scaling or 1.0),
            )
        return cls(**common)
