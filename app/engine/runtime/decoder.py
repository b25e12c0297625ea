"""One configurable decoder-only transformer for every supported architecture (Llama 2/3, Mistral,
Qwen2, Qwen3, Gemma 3). It runs a flat packed batch over a paged KV cache: a single sequence is
just a batch of one.

Weights arrive by their GGUF names, dequantized tensors or (for the C kernels) the file's blocks; q/k/v
and gate/up are fused here so a layer makes three matmuls instead of six.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import torch.nn.functional as F

from app.engine.gguf.model_config import ModelConfig
from app.engine.gguf.quants import GridForm
from app.engine.runtime.kernel_plan import INT4_HEAD_MIN_VOCAB, LAYER_MATRICES, Attention, KernelPlan, RowOps, plan_kernels
from app.engine.runtime.linear import Linear, nbytes, storage_key
from app.engine.runtime.weight_forms import GroupWeight, Matrix, TensorMatrix, as_matrix, embedding_forms, fused
from app.kernels import AttentionMetadata, KVCacheLayer, cpu_attention, cpu_forward, cpu_ops, cpu_qgemm
from app.kernels.cpu_qgemm import C_FORMS

RopeTables = tuple[torch.Tensor, torch.Tensor]  # cos, signed sin at the step's positions


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, ops: RowOps = RowOps.TORCH) -> torch.Tensor:
    """RMS norm over the last dim, by the model's row ops (`KernelPlan.rows`)."""
    if ops is RowOps.C:
        return cpu_ops.rms_norm(x, weight, eps)
    # Normalise in fp32 whatever the compute dtype: bf16 mean-of-squares loses too much. One
    # F.rms_norm call instead of six elementwise ops: the same fp32 numbers (bit-identical here),
    # ~90 fewer Python dispatches and GIL hand-offs per step, which a busy UI thread made costly.
    xf = x.float()
    if weight.dim() == 1:
        return F.rms_norm(xf, (xf.shape[-1],), weight.float(), eps).to(x.dtype)
    # Per-head weights (q/k norm over [tokens, heads, head_dim]): normalise per row, then scale.
    return (F.rms_norm(xf, (xf.shape[-1],), None, eps) * weight.float()).to(x.dtype)


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float, ops: RowOps = RowOps.TORCH
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`x + h` and its RMS norm: one pass with C row ops."""
    if ops is RowOps.C:
        return cpu_ops.add_rms_norm(x, h, weight, eps)
    x = x + h
    return x, rms_norm(x, weight, eps)


def glu(x: torch.Tensor, act: str, ops: RowOps = RowOps.TORCH) -> torch.Tensor:
    """The gated MLP's activation: `act(gate) * up` for `gate, up = x.chunk(2, -1)`."""
    if ops is RowOps.C:
        return cpu_ops.glu(x, act)
    gate, up = x.chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") if act == "gelu_tanh" else F.silu(gate)) * up


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
        """cos and signed sin rows `[N, 1, d]` at `positions`, laid out like the pairs `__call__`
        rotates: gathered once per step, used by every layer."""
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        if self.style == "neox":
            return torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)
        return cos.repeat_interleave(2, -1), torch.stack((-sin, sin), -1).flatten(-2)

    def __call__(self, x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
        """x * cos + partner(x) * signed sin, where partner swaps each rotated pair: five ops per
        call instead of a dozen, the same fp32 products and sums as rotating the halves apart
        (a - b*s == a + b*(-s) exactly). bf16 x times the fp32 tables computes in fp32."""
        cos, sin = tables
        if self.style == "neox":
            partner = x.roll(x.shape[-1] // 2, -1)
        else:
            partner = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
        return (x * cos + partner * sin).to(x.dtype)


class DecoderLayer:
    def __init__(self, cfg: ModelConfig, idx: int, w: dict[str, torch.Tensor | Matrix], rope: RotaryEmbedding,
                 plan: KernelPlan, grids: dict[str, GridForm] | None = None) -> None:
        p = f"blk.{idx}."

        def linear(kind: str, bias: torch.Tensor | None = None) -> Linear:
            names = [p + n for n in LAYER_MATRICES[kind]]
            return Linear(fused([w[n] for n in names], grids, names), bias, settings=plan.settings)

        self.cfg = cfg
        self.plan = plan
        self.ops = plan.rows
        self.window = cfg.layer_window(idx)
        self.rope = rope
        self.attn_norm = w[p + "attn_norm.weight"]
        qkv_bias = torch.cat([w[p + "attn_q.bias"], w[p + "attn_k.bias"], w[p + "attn_v.bias"]]) if cfg.attn_bias else None
        self.qkv = linear("qkv", bias=qkv_bias)
        # q and k are normalised and rotated as one [tokens, q_heads + kv_heads, head_dim] tensor:
        # half the small ops of doing them apart, the same numbers (both are per-head operations).
        self.qk_norm = None
        if cfg.qk_norm:
            q_norm, k_norm = w[p + "attn_q_norm.weight"], w[p + "attn_k_norm.weight"]
            self.qk_norm = torch.cat([q_norm.expand(cfg.num_heads, -1), k_norm.expand(cfg.num_kv_heads, -1)])
        self.o_proj = linear("o_proj")
        self.post_attn_norm = w.get(p + "post_attention_norm.weight")
        self.ffn_norm = w[p + "ffn_norm.weight"]
        self.gate_up = linear("gate_up")
        self.down = linear("down")
        self.post_ffw_norm = w.get(p + "post_ffw_norm.weight")
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim

    def __call__(self, x: torch.Tensor, h: torch.Tensor | None, rope: RopeTables, kv: KVCacheLayer,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream `x` and the previous layer's output `h` (None before the first
        layer) -> this layer's pair: each output is added in the pass of the norm that follows it."""
        eps, ops = self.cfg.rms_norm_eps, self.ops
        if h is None:
            normed = rms_norm(x, self.attn_norm, eps, ops)
        else:
            x, normed = add_rms_norm(x, h, self.attn_norm, eps, ops)
        h = self.attention(normed, rope, kv, meta)
        if self.post_attn_norm is not None:
            h = rms_norm(h, self.post_attn_norm, eps, ops)
        x, normed = add_rms_norm(x, h, self.ffn_norm, eps, ops)
        h = self.down(glu(self.gate_up(normed), self.cfg.hidden_act, ops))
        if self.post_ffw_norm is not None:
            h = rms_norm(h, self.post_ffw_norm, eps, ops)
        return x, h

    def attention(self, x: torch.Tensor, rope: RopeTables, kv: KVCacheLayer, meta: AttentionMetadata) -> torch.Tensor:
        cfg = self.cfg
        q = self.rope_store(self.qkv(x), rope, kv, meta)
        out = torch.empty_like(q)
        if self.plan.attention is Attention.C:
            cpu_attention.unified_attention(q, kv.k, kv.v, out, meta, cfg.attn_scale, self.window, None, **kv.scales,
                                            bf16=cpu_attention.bf16_attention(self.plan.settings))
        else:
            self.plan.unified_attention(q, kv.k, kv.v, out, meta, cfg.attn_scale, self.window, **kv.scales)
        return self.o_proj(out.view(x.shape[0], self.q_size))

    def rope_store(self, qkv: torch.Tensor, rope: RopeTables, kv: KVCacheLayer, meta: AttentionMetadata
                   ) -> torch.Tensor:
        """q `[tokens, heads, head_dim]` from the qkv projection, normed and rotated; k and v (k
        normed and rotated) stored in the paged cache: one C pass with the C attention."""
        cfg = self.cfg
        if self.plan.attention is Attention.C:
            return cpu_attention.rope_store_kv(
                qkv, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.qk_norm, cfg.rms_norm_eps, rope,
                self.rope.style == "neox", kv, meta.slot_mapping)
        n = qkv.shape[0]
        qk = qkv[:, : self.q_size + self.kv_size].reshape(n, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].reshape(n, cfg.num_kv_heads, cfg.head_dim)
        if self.qk_norm is not None:
            qk = rms_norm(qk, self.qk_norm, cfg.rms_norm_eps, self.ops)
        q, k = self.rope(qk, rope).split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        self.plan.store_kv(k.contiguous(), v.contiguous(), kv.k, kv.v, meta.slot_mapping, **kv.scales)
        return q.contiguous()

    def linears(self) -> list[Linear]:
        return [self.qkv, self.o_proj, self.gate_up, self.down]

    def norms(self) -> list[torch.Tensor]:
        return [t for t in (self.attn_norm, self.post_attn_norm, self.ffn_norm, self.post_ffw_norm, self.qk_norm)
                if t is not None]


class DecoderLM:
    """`hidden_states(input_ids [N], positions [N], meta, kv_caches, logits_indices)` -> final hidden
    states `[len(idx), hidden_size]`; `compute_logits` of those -> logits `[len(idx), vocab]`."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor | Matrix], device: torch.device,
                 grids: dict[str, GridForm] | None = None, kv_dtype: torch.dtype | None = None) -> None:
        """`weights`: tensors, or for the C kernels the file's matrices as their blocks
        (`load_gguf(grids=True)`: `BlockTensor`s, whose forms are built from the blocks). `grids`:
        for tensors, their 4/5-bit groups as the file held them (a tensor missing there has none);
        None: look for grids in the values (random weights). `kv_dtype`: the KV cache's storage dtype
        (default the compute dtype): its pools must be allocated with it, since the kernels are
        chosen for it here."""
        self.cfg = cfg
        self.device = device
        self._step_bytes: dict[int, int] = {}  # rows -> weight_bytes_per_step(rows)
        embed = weights["token_embd.weight"]
        head_name = "output.weight" if "output.weight" in weights else "token_embd.weight"  # tied unless
        lm_head = weights[head_name]
        self.final_norm = weights["output_norm.weight"]
        self.dtype = embed.dtype
        self.kv_dtype = kv_dtype or self.dtype
        plan = plan_kernels(cfg, self.dtype, device, self.kv_dtype)  # the settings are read here, once
        # The output projection is the biggest matrix (262k x 640 for Gemma 3): its packed copy (int8,
        # int4 for a large vocabulary with bf16 compute; 8-bit groups with fp32 compute) cuts the
        # bytes a small batch reads; above its measured crossover the dense weight serves.
        self.head = Linear(as_matrix(lm_head, (grids or {}).get(head_name), fit_grid=grids is None),
                           requantize_int4=cfg.vocab_size >= INT4_HEAD_MIN_VOCAB, settings=plan.settings)
        self.embed, self.embed_rows = self._embedding(embed, lm_head is embed, grids)
        rope_global = RotaryEmbedding(
            cfg.head_dim, cfg.max_position, cfg.rope_theta, cfg.rope_style, cfg.rope_scaling_factor, device
        )
        rope_local = rope_global
        if cfg.rope_theta_local is not None:
            rope_local = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta_local, cfg.rope_style, 1.0, device)
        self.ropes = list({rope_global: None, rope_local: None})
        self.layers = [
            DecoderLayer(cfg, i, weights, rope_local if cfg.is_sliding(i) else rope_global, plan, grids)
            for i in range(cfg.num_layers)
        ]
        linears = [lin for layer in self.layers for lin in layer.linears()] + [self.head]
        cpu_qgemm.consolidate([lin.packed for lin in linears if isinstance(lin.packed, C_FORMS)])
        one_call = plan.rows is RowOps.C and plan.attention is Attention.C and cpu_forward.takes_layers(self.layers)
        self.plan = dataclasses.replace(plan, one_call=one_call)
        self.c_layers = cpu_forward.OneCallLayers(self.layers) if one_call else None

    def _embedding(self, embed: torch.Tensor | Matrix, tied: bool, grids: dict[str, GridForm] | None
                   ) -> tuple[torch.Tensor | None, GroupWeight | None]:
        """The token table as a tensor, or as C kernels' groups the batch's rows are read from (the
        registry's `embedding` op). With fp32 compute only the batch's rows are read from the table
        once the head keeps its own copy: a tied table from the head's 4/5/6/8-bit groups (exact for
        Q8_0, Q4 and Q5 sources; Gemma 3's 262k x 640: no second copy instead of 671 MB), an untied
        4/5/6-bit one from its own groups, any other kept in fp16 where its values fit."""
        if isinstance(embed, torch.Tensor):  # a tensor's grid only as the file gave it: none fitted
            embed = TensorMatrix(embed, (grids or {}).get("token_embd.weight"), fit_grid=False)
        table, rows, self.embed_plan = embedding_forms(embed, self.head, tied)
        return table, rows

    def weight_bytes_per_step(self, rows: int = 1) -> int:
        """Bytes a forward of `rows` logits rows reads from the weights whatever its batch: every
        layer matrix and norm in the kernel that many rows use, and the output projection (the
        embedding table only for the batch's rows: negligible). Kept per row count: the kernels are
        chosen once loaded, and every stats snapshot asks (counting walks every matrix)."""
        counted = self._step_bytes.get(rows)
        if counted is None:
            counted = self._step_bytes[rows] = self._count_weight_bytes(rows)
        return counted

    def _count_weight_bytes(self, rows: int) -> int:
        linears = [lin for layer in self.layers for lin in layer.linears()]
        tensors = [t for lin in linears for t in lin.tensors(rows)] + self.head.tensors(rows)
        tensors += [t for layer in self.layers for t in layer.norms()] + [self.final_norm]
        return _unique_bytes(tensors)

    def resident_weight_bytes(self) -> int:
        """Every weight byte held, int8 copies included (compare with the GGUF file's size)."""
        linears = [lin for layer in self.layers for lin in layer.linears()] + [self.head]
        held = (self.embed, self.embed_rows, self.final_norm)
        tensors = [t for lin in linears for t in lin.resident()] + [t for t in held if t is not None]
        return _unique_bytes(tensors + [t for layer in self.layers for t in layer.norms()])

    @torch.inference_mode()
    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata | list[AttentionMetadata],
        kv_caches: list[KVCacheLayer],
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final-normed hidden states at `logits_indices` (every row if None): what a CUDA graph
        captures. The vocabulary projection stays outside, so graphs skip it for padding rows.

        `meta` is one step's metadata, or one per layer: with a hybrid KV cache each KV cache group
        (full-attention layers, sliding-window layers) has its own block tables and slots."""
        if kv_caches[0].k.dtype != self.kv_dtype:  # the kernels were chosen for kv_dtype: fail, not crash
            raise ValueError(f"a {kv_caches[0].k.dtype} KV cache given to a model built for {self.kv_dtype}")
        x = self.embed[input_ids].to(self.dtype) if self.embed_rows is None else self.embed_rows.rows(input_ids)
        if self.cfg.embed_scale is not None:
            x = (x.float() * self.cfg.embed_scale).to(self.dtype)
        # Gathered inside the forward (so a CUDA graph captures the gather), once per RoPE base.
        tables = {rope: rope.tables(positions) for rope in self.ropes}
        metas = meta if isinstance(meta, list) else itertools.repeat(meta)
        if self.c_layers is not None:
            x, h = self.c_layers.run(x, tables, kv_caches, list(itertools.islice(metas, len(self.layers))))
        else:
            h = None
            for layer, kv, layer_meta in zip(self.layers, kv_caches, metas):
                x, h = layer(x, h, tables[layer.rope], kv, layer_meta)
        if logits_indices is not None:
            x, h = x[logits_indices], h[logits_indices]
        return add_rms_norm(x, h, self.final_norm, self.cfg.rms_norm_eps, self.plan.rows)[1]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden `[n, hidden_size]` -> fp32 logits `[n, vocab]`."""
        return self.head(hidden).float()


def _unique_bytes(items: list) -> int:
    """Bytes of `items` (tensors, packed weights), each storage once (a tied head is the embedding)."""
    sizes = {storage_key(t): nbytes(t) for t in items}
    return sum(sizes.values())
