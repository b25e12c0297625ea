"""The fp32 CPU path's decoder layers in one C call (`cpu_forward.c`): the same kernels the Python
layer (`decoder.DecoderLayer`) calls one by one, in the same order, so the same bits; without the
~9 ctypes calls a layer and the Python around them. `DecoderLM` takes it when every layer's
matrices are 4/5/8-bit groups without bias and the C attention serves the step; otherwise its layers
run one by one."""

from __future__ import annotations

import ctypes
import functools

import torch

from app.kernels import cpu_build, cpu_ops
from app.kernels.cpu_attention import KVPools, bf16_attention, int32_metadata, int64_slots, kv_pools
from app.kernels.cpu_qgemm import C_FORMS
from app.kernels.kv_cache import KVCacheLayer
from app.kernels.metadata import AttentionMetadata

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
MAX_ROPES = 2


class _Meta(ctypes.Structure):
    _fields_ = [("block_table", _ptr), ("cu_seqlens_q", _ptr), ("seq_lens", _ptr), ("slots", _ptr),
                ("max_blocks", _i64), ("num_seqs", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [(name, _ptr) for name in ("qkv", "o", "gate_up", "down", "attn_norm", "post_attn_norm", "ffn_norm",
                                          "post_ffw_norm", "qk_norm", "qkv_bias")] + [
        ("kv", KVPools), ("window", _i64), ("rope", _i64), ("group", _i64)]


class _Step(ctypes.Structure):
    _fields_ = [(name, _i64) for name in ("M", "hidden", "heads", "kv_heads", "head_dim", "ffn", "block_size", "act",
                                         "neox", "threads", "attn_bf16")] + [
        ("eps", _f32), ("scale", _f32), ("cos", _ptr * MAX_ROPES), ("sin", _ptr * MAX_ROPES), ("metas", _ptr)] + [
        (name, _ptr) for name in ("x", "h", "normed", "qkv", "q", "attn", "gate_up", "act_out")]


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return cpu_build.load({"forward_layers": [_ptr, _i64, _ptr]},
                          restypes={"forward_layers": ctypes.c_int})


def takes_layers(layers: list) -> bool:
    """Whether these layers (`DecoderLayer`s) can run here in one call: every matrix 4/5/8-bit groups
    without a bias (but q, k and v's, fp32), widths the row kernels cover, an activation the C kernel
    has, the library built."""
    if not layers or _library() is None:
        return False
    cfg = layers[0].cfg
    return (cfg.hidden_act in cpu_ops.GLU_ACTIVATIONS and cfg.hidden_size % 8 == 0
            and all(isinstance(lin.packed, C_FORMS) and lin.weight is None and lin.dense is None
                    for layer in layers for lin in layer.linears())
            and all(lin.bias is None for layer in layers for lin in layer.linears()[1:])
            and all(_fp32_vector(layer.qkv.bias, layer.qkv.packed.out_features) for layer in layers
                    if layer.qkv.bias is not None)
            and all(layer.gate_up.packed.out_features % 16 == 0 for layer in layers)
            and all(t.dtype == torch.float32 and t.is_contiguous() for layer in layers for t in layer.norms())
            and len({layer.rope for layer in layers}) <= MAX_ROPES)


def _fp32_vector(t: torch.Tensor, n: int) -> bool:
    return t.dtype == torch.float32 and t.is_contiguous() and t.shape == (n,)


class OneCallLayers:
    """A model's layers run by `forward_layers` (`takes_layers` said yes). What does not change
    between steps (weights, norms, the KV pools) is described once; a step fills in its buffers,
    RoPE tables and metadata: describing every layer anew each step cost a small model's step a
    visible share of its time."""

    _BUFFERS = ("x", "h", "normed", "qkv", "q", "attn", "gate_up", "act_out")

    def __init__(self, layers: list) -> None:
        self.layers = layers
        cfg = self.cfg = layers[0].cfg
        q_size, qkv_size = cfg.num_heads * cfg.head_dim, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.ffn = layers[0].gate_up.packed.out_features // 2
        self.widths = dict(zip(self._BUFFERS, (cfg.hidden_size, cfg.hidden_size, cfg.hidden_size, qkv_size, q_size,
                                               q_size, 2 * self.ffn, self.ffn)))
        self.ropes = list(dict.fromkeys(layer.rope for layer in layers))
        self._descs: ctypes.Array | None = None
        self._pools: tuple | None = None  # the KV pools the descriptors point at
        self._groups: list[int] | None = None

    def run(self, x: torch.Tensor, tables: dict, kv_caches: list[KVCacheLayer], metas: list[AttentionMetadata]
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer over the step's hidden states `x` `[M, hidden]` (`cpu_attention.handles_layer`
        said yes for the step): the residual stream and the last layer's output, not yet added (as
        the Python layers leave them)."""
        cfg, m = self.cfg, x.shape[0]
        descs = self._describe(kv_caches, metas)
        buffer = torch.empty(m * sum(self.widths.values()), dtype=torch.float32)
        pointers, offset = {}, 0
        for name, width in self.widths.items():
            pointers[name] = buffer.data_ptr() + 4 * offset
            offset += m * width
        x_out, h_out = (buffer[i * m * cfg.hidden_size : (i + 1) * m * cfg.hidden_size].view(m, -1) for i in (0, 1))
        x_out.copy_(x)
        threads = torch.get_num_threads()
        keep = []  # every tensor the C side reads, alive until it returns
        metas_c = (_Meta * (max(self._groups) + 1))()
        seen: set[int] = set()
        for meta, group in zip(metas, self._groups):
            if group not in seen:
                seen.add(group)
                cu, lens, table = int32_metadata(meta)
                slots = int64_slots(meta.slot_mapping)
                keep.append(slots)
                metas_c[group] = _Meta(table.data_ptr(), cu.data_ptr(), lens.data_ptr(), slots.data_ptr(),
                                       table.shape[1], meta.num_seqs)
        step = _Step(M=m, hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                     head_dim=cfg.head_dim, ffn=self.ffn, block_size=kv_caches[0].k.shape[1],
                     act=cpu_ops.GLU_ACTIVATIONS[cfg.hidden_act], neox=self.layers[0].rope.style == "neox",
                     threads=threads, attn_bf16=bf16_attention(self.layers[0].plan.settings), eps=cfg.rms_norm_eps,
                     scale=cfg.attn_scale, metas=ctypes.addressof(metas_c), **pointers)
        for i, rope in enumerate(self.ropes):
            cos, sin = (t.contiguous() for t in tables[rope])
            keep += [cos, sin]
            step.cos[i], step.sin[i] = cos.data_ptr(), sin.data_ptr()
        if _library().forward_layers(descs, len(self.layers), ctypes.byref(step)):
            raise MemoryError(f"no memory for the scratch of a {m}-row step (quantized activations, attention)")
        return x_out, h_out

    def _describe(self, kv_caches: list[KVCacheLayer], metas: list[AttentionMetadata]) -> ctypes.Array:
        """The layers' descriptors, made again only when the KV pools or the layers' groups change."""
        pools = tuple(kv.k.data_ptr() for kv in kv_caches)
        if pools != self._pools:
            self._descs = (_Layer * len(self.layers))()
            for desc, layer, kv in zip(self._descs, self.layers, kv_caches):
                _describe(desc, layer, kv, self.ropes.index(layer.rope))
            self._pools, self._groups = pools, None
        index: dict[int, int] = {}
        groups = [index.setdefault(id(meta), len(index)) for meta in metas]
        if groups != self._groups:
            for desc, group in zip(self._descs, groups):
                desc.group = group
            self._groups = groups
        return self._descs


def _describe(desc: _Layer, layer, kv: KVCacheLayer, rope: int) -> None:
    def ptr(t: torch.Tensor | None) -> int | None:
        return None if t is None else t.data_ptr()

    desc.qkv, desc.o, desc.gate_up, desc.down = (lin.packed._desc_ptr for lin in layer.linears())
    desc.attn_norm, desc.post_attn_norm = ptr(layer.attn_norm), ptr(layer.post_attn_norm)
    desc.ffn_norm, desc.post_ffw_norm, desc.qk_norm = ptr(layer.ffn_norm), ptr(layer.post_ffw_norm), ptr(layer.qk_norm)
    desc.qkv_bias = ptr(layer.qkv.bias)
    desc.kv = kv_pools(kv.k, kv.v, kv.k_scale, kv.v_scale)
    desc.window, desc.rope = layer.window or 0, rope
