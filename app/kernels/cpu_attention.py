"""The fp32 CPU path's paged attention and KV store in C (`cpu_attention.c`, AVX2), and the step
before them (q/k norm, RoPE and the KV store in one pass over the qkv projection): the torch
reference gathers every decoding sequence's blocks into a contiguous copy per layer and runs a
masked SDPA over the padded batch; the C kernel reads the keys and values in place.

Each (query row, head) is computed on its own, over its keys in position order: its numbers do not
depend on the rest of the batch, on how a prompt was chunked, or on the threads. The reference
stays the specification (`tests/kernels/test_cpu_attention.py` holds the kernel to it) and serves
whatever this one does not take (it takes fp32 queries over fp32, fp16 or int8 caches): bf16 or fp8
caches, CUDA tensors, machines without AVX2 or a C compiler, and `LOCALBATCH_CPU_ATTENTION=torch`
(for comparisons). An int8 cache is stored as `kv_quant.quantize_kv_ref` stores it, bit for bit,
and attended as the reference attends it (scores times the keys' scales, weights times the
values'), in fp32: the C kernel widens each int8 element exactly.

With `LOCALBATCH_CPU_ATTENTION_BF16=1`, where the CPU has AVX512_BF16 (`bf16_attention`), the dot
products run in bf16 instead (vdpbf16ps, fp32 sums): queries and keys rounded to bf16 for Q.K, the
softmax's weights and the values for P.V, every row through the tiles (decode rows too: a row's
numbers must not depend on whether it came in a prompt chunk or alone).
`reference_bf16.unified_attention_bf16_ref` states that arithmetic. Off by default: as fast as fp32
on a prompt and slower on a decode (docs/tuning.md); `LOCALBATCH_CPU_ISA=avx2` keeps fp32 too.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from app.kernels import cpu_build
from app.kernels.settings import ATTENTION_ENV, KernelSettings
from app.kernels.kv_cache import KVCacheLayer
from app.kernels.metadata import AttentionMetadata

BACKEND_ENV = ATTENTION_ENV  # "torch": the reference instead of the C kernel (read in `settings`)
KV_KINDS = {torch.float32: 0, torch.float16: 1, torch.int8: 2}  # cpu_kernels.h's KV_F32, KV_F16, KV_I8
CACHE_DTYPES = tuple(KV_KINDS)
MAX_HEADS = 128  # query heads the kernel's stack buffers hold


class KVPools(ctypes.Structure):
    """cpu_kernels.h's `kv_pools`: one layer's K and V pools, an int8 pool's scales, the element kind."""

    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("k_scale", ctypes.c_void_p),
                ("v_scale", ctypes.c_void_p), ("kind", ctypes.c_int64)]


def kv_pools(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> KVPools:
    """The descriptor the C kernels read a layer's cache through (the tensors must outlive its use)."""
    def ptr(t: torch.Tensor | None) -> int | None:
        return None if t is None else t.data_ptr()

    return KVPools(k_cache.data_ptr(), v_cache.data_ptr(), ptr(k_scale), ptr(v_scale), KV_KINDS[k_cache.dtype])


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    return cpu_build.load({
        "paged_attention": [ptr, ptr, i64, i32, i32, i32, ptr, i32, ptr, i64, ptr, ptr, i32, f32, i64, f32, i32, i32],
        "attention_bf16_supported": [],
        "store_kv": [ptr, ptr, ptr, i64, i32, i32, ptr],
        "rope_store_kv": [ptr, i64, i32, i32, i32, ptr, f32, ptr, ptr, i32, ptr, ptr, ptr],
    }, restypes={"paged_attention": ctypes.c_int, "attention_bf16_supported": ctypes.c_int})


def library() -> ctypes.CDLL | None:
    """The C library with these kernels, None where it does not build here."""
    return _library()


def available(settings: KernelSettings | None = None) -> bool:
    """The kernels are built here and not turned off (`LOCALBATCH_CPU_ATTENTION=torch`). What they
    take is the registry's to say (`registry.paged_c`, `registry.rope_c`)."""
    return (settings or KernelSettings.from_env()).c_attention and _library() is not None


@functools.lru_cache(maxsize=1)
def bf16_supported() -> bool:
    """The CPU runs the bf16 dot products (AVX512_BF16 and the AVX-512 they use, as the C library's
    cpuid check confirms; /proc/cpuinfo's `avx512_bf16` alone is not trusted: some VMs list what faults)."""
    lib = _library()
    return lib is not None and lib.attention_bf16_supported() == 1


def bf16_attention(settings: KernelSettings | None = None) -> bool:
    """Whether the C attention's dot products run in bf16: `LOCALBATCH_CPU_ATTENTION_BF16=1`, the CPU
    has AVX512_BF16, and `LOCALBATCH_CPU_ISA=avx2` does not keep an AVX2 machine's kernels."""
    settings = settings or KernelSettings.from_env()
    return settings.attention_bf16 and settings.isa != "avx2" and bf16_supported()


def math_name(settings: KernelSettings | None = None) -> str:
    """The C attention's arithmetic in words (`localbatch doctor`)."""
    if bf16_attention(settings):
        return "bf16 dot products (AVX512_BF16), fp32 softmax"
    settings = settings or KernelSettings.from_env()
    why = ": no AVX512_BF16 here" if settings.attention_bf16 and not bf16_supported() else ""
    return f"fp32 (FMA){why}"


def int64_slots(slot_mapping: torch.Tensor) -> torch.Tensor:
    """`slot_mapping` as the kernels read it: contiguous int64."""
    return slot_mapping.to(torch.int64).contiguous()


def rope_store_kv(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, norm_w: torch.Tensor | None,
                  eps: float, tables: tuple[torch.Tensor, torch.Tensor], neox: bool, kv: KVCacheLayer,
                  slot_mapping: torch.Tensor) -> torch.Tensor:
    """The qkv projection's rows `[tokens, (heads + 2 * kv_heads) * head_dim]` in one C pass: q and k
    heads RMS-normed by `norm_w` (`[heads + kv_heads, head_dim]`, if given) and rotated by the
    step's cos / signed-sin `tables` (`[tokens, 1, head_dim]` fp32 each), k and v stored in their
    slots of `kv`. Returns q `[tokens, heads, head_dim]` (the registry chose the C attention for the model)."""
    qkv = qkv.contiguous()
    cos, sin = (t.contiguous() for t in tables)
    slots = int64_slots(slot_mapping)
    norm = None if norm_w is None else norm_w.float().contiguous()
    q = torch.empty((qkv.shape[0], heads, head_dim), dtype=torch.float32)
    _library().rope_store_kv(
        qkv.data_ptr(), qkv.shape[0], heads, kv_heads, head_dim, None if norm is None else norm.data_ptr(), eps,
        cos.data_ptr(), sin.data_ptr(), neox, q.data_ptr(), slots.data_ptr(),
        ctypes.byref(kv_pools(kv.k, kv.v, kv.k_scale, kv.v_scale)),
    )
    return q


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """`store_kv_ref` for an fp32, fp16 or int8 cache (the registry chose the C attention): the same bits."""
    k, v = k.float().contiguous(), v.float().contiguous()
    slots = int64_slots(slot_mapping)
    _library().store_kv(k.data_ptr(), v.data_ptr(), slots.data_ptr(), k.shape[0], k_cache.shape[2], k_cache.shape[3],
                        ctypes.byref(kv_pools(k_cache, v_cache, k_scale, v_scale)))


def unified_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, meta: AttentionMetadata,
    scale: float, sliding_window: int | None = None, softcap: float | None = None,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, bf16: bool | None = None,
) -> torch.Tensor:
    """`unified_attention_ref` for an fp32, fp16 or int8 cache (the registry chose the C attention); writes and
    returns `out`. `bf16`: the bf16 dot products (`unified_attention_bf16_ref`); None: `bf16_attention()`,
    read per call (a model passes its plan's)."""
    if bf16 is None:
        bf16 = bf16_attention()
    num_tokens, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    cu, lens, table = int32_metadata(meta)
    threads = torch.get_num_threads()
    q = q.contiguous()
    target = out if out.is_contiguous() else torch.empty_like(q)
    failed = _library().paged_attention(
        q.data_ptr(), target.data_ptr(), num_tokens, heads, kv_heads, head_dim,
        ctypes.byref(kv_pools(k_cache, v_cache, k_scale, v_scale)), k_cache.shape[1], table.data_ptr(), table.shape[1],
        cu.data_ptr(), lens.data_ptr(), meta.num_seqs, scale, sliding_window or 0, softcap or 0.0, threads, bf16,
    )
    if failed:
        raise MemoryError(f"no memory for the attention's scratch over {num_tokens} rows")
    if target is not out:
        out.copy_(target)
    return out


def int32_metadata(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cu_seqlens_q, seq_lens and block_table as contiguous int32, made once per step (every layer
    shares them)."""
    key = "cpu_attention_int32"
    if key not in meta.derived:
        meta.derived[key] = tuple(
            t.to(torch.int32).contiguous() for t in (meta.cu_seqlens_q, meta.seq_lens, meta.block_table)
        )
    return meta.derived[key]
