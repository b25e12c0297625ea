"""One configurable decoder-only transformer for every supported architecture (Llama 2/3, Mistral,
Qwen2, Qwen3, Gemma 3). It runs a flat packed batch over a paged KV cache: a single sequence is
just a batch of one.

Weights arrive by their GGUF names, already dequantized; q/k/v and gate/up are fused here so a
layer makes three matmuls instead of six.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from app.engine.gguf.model_config import ModelConfig
from app.engine.runtime.attention import paged_attention
from app.engine.runtime.kernel_choice import HeadChoice, choose_head
from app.kernels import AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]
RopeTables = tuple[torch.Tensor, torch.Tensor]  # cos, sin at the step's positions


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32 whatever the compute dtype: bf16 mean-of-squares loses too much. One
    # F.rms_norm call instead of six elementwise ops: the same fp32 numbers (bit-identical here),
    # ~90 fewer Python dispatches and GIL hand-offs per step, which a busy UI thread made costly.
    xf = x.float()
    if weight.dim() == 1:
        return F.rms_norm(xf, (xf.shape[-1],), weight.float(), eps).to(x.dtype)
    # Per-head weights (q/k norm over [tokens, heads, head_dim]): normalise per row, then scale.
    return (F.rms_norm(xf, (xf.shape[-1],), None, eps) * weight.float()).to(x.dtype)


class RotaryEmbedding:
    """cos/sin tables indexed by position. `style` "neox" rotates (i, i+d/2) pairs, "normal"
    rotates adjacent (2i, 2i+1) pairs (llama.cpp's permuted Llama weights)."""

    def __init__(self, head_dim: int, max_position: int, theta: float, style: str, scaling: float, device) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        pos = torch.arange(max_position, dtype=torch.float64) / scaling
        angles = torch.outer(pos, inv_freq)
        self.cos = angles.cos().float().to(device)
        self.sin = angles.sin().float().to(device)
        self.style = style

    def tables(self, positions: torch.Tensor) -> RopeTables:
        """cos and sin rows `[N, 1, d/2]` at `positions`: gathered once per step, used by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def __call__(self, x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
        cos, sin = tables
        xf = x.float()
        if self.style == "neox":
            x1, x2 = xf.chunk(2, dim=-1)
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
        return out.to(x.dtype)


class DecoderLayer:
    def __init__(self, cfg: ModelConfig, idx: int, w: dict[str, torch.Tensor], rope: RotaryEmbedding) -> None:
        p = f"blk.{idx}."
        self.cfg = cfg
        self.window = cfg.layer_window(idx)
        self.rope = rope
        self.attn_norm = w[p + "attn_norm.weight"]
        self.qkv = torch.cat([w[p + "attn_q.weight"], w[p + "attn_k.weight"], w[p + "attn_v.weight"]])
        self.qkv_bias = (
            torch.cat([w[p + "attn_q.bias"], w[p + "attn_k.bias"], w[p + "attn_v.bias"]]) if cfg.attn_bias else None
        )
        # q and k are normalised and rotated as one [tokens, q_heads + kv_heads, head_dim] tensor:
        # half the small ops of doing them apart, the same numbers (both are per-head operations).
        self.qk_norm = None
        if cfg.qk_norm:
            q_norm, k_norm = w[p + "attn_q_norm.weight"], w[p + "attn_k_norm.weight"]
            self.qk_norm = torch.cat([q_norm.expand(cfg.num_heads, -1), k_norm.expand(cfg.num_kv_heads, -1)])
        self.o_proj = w[p + "attn_output.weight"]
        self.post_attn_norm = w.get(p + "post_attention_norm.weight")
        self.ffn_norm = w[p + "ffn_norm.weight"]
        self.gate_up = torch.cat([w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"]])
        self.down = w[p + "ffn_down.weight"]
        self.post_ffw_norm = w.get(p + "post_ffw_norm.weight")
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim

    def __call__(self, x: torch.Tensor, rope: RopeTables, kv: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        eps = self.cfg.rms_norm_eps
        h = self.attention(rms_norm(x, self.attn_norm, eps), rope, kv, meta)
        if self.post_attn_norm is not None:
            h = rms_norm(h, self.post_attn_norm, eps)
        x = x + h
        h = self.mlp(rms_norm(x, self.ffn_norm, eps))
        if self.post_ffw_norm is not None:
            h = rms_norm(h, self.post_ffw_norm, eps)
        return x + h

    def attention(self, x: torch.Tensor, rope: RopeTables, kv: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        cfg = self.cfg
        qkv = F.linear(x, self.qkv, self.qkv_bias)
        n = x.shape[0]
        qk = qkv[:, : self.q_size + self.kv_size].reshape(n, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].reshape(n, cfg.num_kv_heads, cfg.head_dim)
        if self.qk_norm is not None:
            qk = rms_norm(qk, self.qk_norm, cfg.rms_norm_eps)
        q, k = self.rope(qk, rope).split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        out = paged_attention(q.contiguous(), k.contiguous(), v.contiguous(), kv, meta, cfg.attn_scale, self.window)
        return F.linear(out.reshape(n, self.q_size), self.o_proj)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.cfg.hidden_act == "gelu_tanh" else F.silu(gate)
        return F.linear(act * up, self.down)


class Int8Head:
    """The output projection as int8 weights with per-row scales, for bf16 serving on the CPU.

    Decoding is weight-bandwidth bound and the vocabulary projection is the biggest weight (262k x
    640 for Gemma 3): int8 halves its bytes (B=1 decode step 30 -> 22 ms here). `_weight_int8pack_mm`
    dequantises inside the kernel and computes each row independently, but its cost grows fast
    with rows: above the measured crossover (`kernel_choice`) the bf16 weight serves instead, so a
    row's logits carry int8 rounding in small batches and not in large ones (within the oracle's
    tolerance either way)."""

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.float()
        scale = (w.abs().amax(1) / 127.0).clamp(min=1e-12)
        self.q = torch.round(w / scale.unsqueeze(1)).clamp(-127, 127).to(torch.int8).contiguous()
        self.scale = scale.to(torch.bfloat16)

    @staticmethod
    def supported(weight: torch.Tensor) -> bool:
        return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and hasattr(torch, "_weight_int8pack_mm")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty((0, self.q.shape[0]))
        return torch._weight_int8pack_mm(x.to(torch.bfloat16), self.q, self.scale)


class DecoderLM:
    """`hidden_states(input_ids [N], positions [N], meta, kv_caches, logits_indices)` -> final hidden
    states `[len(idx), hidden_size]`; `compute_logits` of those -> logits `[len(idx), vocab]`."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.embed = weights["token_embd.weight"]
        self.lm_head = weights.get("output.weight", self.embed)  # tied unless the file has its own
        self.final_norm = weights["output_norm.weight"]
        self.dtype = self.embed.dtype
        self.int8_head = Int8Head(self.lm_head) if Int8Head.supported(self.lm_head) else None
        self.head_choice = self._choose_head() if self.int8_head is not None else None
        rope_global = RotaryEmbedding(
            cfg.head_dim, cfg.max_position, cfg.rope_theta, cfg.rope_style, cfg.rope_scaling_factor, device
        )
        rope_local = rope_global
        if cfg.rope_theta_local is not None:
            rope_local = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta_local, cfg.rope_style, 1.0, device)
        self.ropes = list({rope_global: None, rope_local: None})
        self.layers = [
            DecoderLayer(cfg, i, weights, rope_local if cfg.is_sliding(i) else rope_global)
            for i in range(cfg.num_layers)
        ]

    def _choose_head(self) -> HeadChoice:
        lm_head, int8_head = self.lm_head, self.int8_head
        return choose_head(int8_head, lambda x: F.linear(x, lm_head), tuple(lm_head.shape), lm_head.dtype)

    def weight_bytes_per_step(self, rows: int = 1) -> int:
        """Bytes a forward reads from the weights whatever its batch: every layer tensor and the
        output projection in the kernel `rows` logits rows use (the embedding table only for the
        batch's rows: negligible)."""
        tensors = [t for layer in self.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]
        tensors.append(self.final_norm)
        if self.int8_head is not None and self.head_choice.use_int8(rows):
            tensors += [self.int8_head.q, self.int8_head.scale]
        else:
            tensors.append(self.lm_head)
        sizes = {t.data_ptr(): t.numel() * t.element_size() for t in tensors}  # shared tensors once
        return sum(sizes.values())

    @torch.inference_mode()
    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final-normed hidden states at `logits_indices` (every row if None): what a CUDA graph
        captures. The vocabulary projection stays outside, so graphs skip it for padding rows."""
        x = self.embed[input_ids]
        if self.cfg.embed_scale is not None:
            x = (x.float() * self.cfg.embed_scale).to(self.dtype)
        # Gathered inside the forward (so a CUDA graph captures the gather), once per RoPE base.
        tables = {rope: rope.tables(positions) for rope in self.ropes}
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, tables[layer.rope], kv, meta)
        if logits_indices is not None:
            x = x[logits_indices]
        return rms_norm(x, self.final_norm, self.cfg.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden `[n, hidden_size]` -> fp32 logits `[n, vocab]`."""
        if self.int8_head is not None and self.head_choice.use_int8(hidden.shape[0]):
            return self.int8_head(hidden).float()
        return F.linear(hidden, self.lm_head).float()
