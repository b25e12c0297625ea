"""The KV pool: which dtype a layer's cache is stored in (`kv_cache_dtype`), what a token costs in
it, and allocating it once at start."""

from __future__ import annotations

import math

import torch

from app.engine.gguf.model_config import ModelConfig
from app.engine.runtime.kv_cache_spec import KVCacheSpec
from app.engine.types.errors import LocalbatchError
from app.kernels import KVCacheLayer, cpu_attention
from app.kernels.cpu_memory import huge_page_region
from app.kernels.kv_quant import SCALE_DTYPE, is_quantized_kv, scale_bytes

_STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8,
            "fp8_e4m3": torch.float8_e4m3fn}


def resolve_kv_cache_dtype(name: str, compute_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The storage dtype for `kv_cache_dtype` `name`. "auto": the compute dtype, except fp32 compute
    on a CPU whose C attention kernel builds: fp16 there (llama.cpp's default KV type). At many
    sequences attention reads the whole context of each from memory every layer; fp16 halves that
    (a faster step: docs/tuning.md) and doubles the tokens the budget holds, still close to
    llama.cpp's logprobs (tests/engine/test_oracle.py). Raises LocalbatchError where the device cannot run it."""
    if name == "auto":
        if compute_dtype == torch.float32 and device.type == "cpu" and cpu_attention.available():
            return torch.float16
        return compute_dtype
    if name not in _STORAGE:
        raise LocalbatchError(f"unknown kv_cache_dtype {name!r} (choose auto, {', '.join(_STORAGE)})")
    if name == "fp8_e4m3":
        _check_fp8(device)
    return _STORAGE[name]


def _check_fp8(device: torch.device) -> None:
    if device.type != "cuda":
        raise LocalbatchError("kv_cache_dtype fp8_e4m3 needs CUDA; on CPU use int8")
    # Triton converts float8e4nv natively from sm_89 (Ada, Hopper) on.
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise LocalbatchError(
            f"kv_cache_dtype fp8_e4m3 needs a GPU of compute capability 8.9 or newer (this one is "
            f"{major}.{minor}); use int8"
        )


def kv_sizes(dtype: torch.dtype) -> dict[str, int]:
    """The byte sizes `ModelConfig.kv_bytes_per_token` / `kv_bytes_read` take for a cache of
    `dtype`: its element size and, quantized, the scale bytes per (token, KV head)."""
    return {"dtype_size": dtype.itemsize, "scale_bytes": scale_bytes(dtype)}


def allocate_kv_caches(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
    spec: KVCacheSpec | None = None,
) -> list[KVCacheLayer]:
    """One `KVCacheLayer` per layer, zeroed, with fp32 scales when `dtype` is quantized. With a KV
    cache spec, a page holds `spec.layers_per_block` layers: the pool has that many tensors, and
    layer l is handed the one of its slot (layers of different groups share a tensor, in different
    blocks)."""
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)

    def layer() -> KVCacheLayer:
        scales = (None, None)
        if is_quantized_kv(dtype):
            scales = (_zeros(shape[:3], SCALE_DTYPE, device), _zeros(shape[:3], SCALE_DTYPE, device))
        return KVCacheLayer(_zeros(shape, dtype, device), _zeros(shape, dtype, device), *scales)

    if spec is None:
        return [layer() for _ in range(cfg.num_layers)]
    pool = [layer() for _ in range(spec.layers_per_block)]
    return [pool[s.slot] for s in spec.layer_slots()]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled pool. Attention kernels may read (and mask) slots past a sequence's end, so they
    must hold finite values (scales included). On the CPU the zeros come from `huge_page_region`,
    as the weights' memory does: a pool of several GB costs no start-up time and no RSS until
    used, and a long context's decode, which reads every key and value of it a step, reads them
    from huge pages (docs/tuning.md)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.frombuffer(huge_page_region(nbytes), dtype=dtype, count=math.prod(shape)).view(shape)


# ---- one token block's bytes, for the KV disk tier ------------------------------------------------
def _block_tensors(layer: KVCacheLayer) -> list[torch.Tensor]:
    return [t for t in (layer.k, layer.v, layer.k_scale, layer.v_scale) if t is not None]


def block_nbytes(kv_caches: list[KVCacheLayer]) -> int:
    """The bytes of one token block over every layer (K, V and, quantized, their scales)."""
    return sum(t[0].numel() * t.element_size() for layer in kv_caches for t in _block_tensors(layer))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A pool tensor as [num_blocks, bytes of one block]."""
    return t.reshape(t.shape[0], -1).view(torch.uint8)


def read_blocks(kv_caches: list[KVCacheLayer], layer_groups: list[int], block_ids: list[list[int]]) -> torch.Tensor:
    """Host copies of token blocks, one row each: row r holds every layer in order, layer l's K, V
    (and scales) from pool block `block_ids[r][layer_groups[l]]`. A copy, so the pool blocks may be
    reused at once."""
    out = torch.empty(len(block_ids), block_nbytes(kv_caches), dtype=torch.uint8)
    runs = {g: _runs(range(len(block_ids)), [ids[g] for ids in block_ids]) for g in set(layer_groups)}
    offset = 0
    for layer, g in zip(kv_caches, layer_groups, strict=True):
        for t in _block_tensors(layer):
            rows = _rows(t)
            n = rows.shape[1]
            for r, b, k in runs[g]:
                _copy(out[r : r + k, offset : offset + n], rows[b : b + k])
            offset += n
    return out


def write_blocks(kv_caches: list[KVCacheLayer], layer_groups: list[int], payload: torch.Tensor,
                 dest: dict[int, tuple[list[int], list[int]]]) -> None:
    """The inverse of `read_blocks`: for each group g in `dest` = (rows, pool blocks), payload row
    rows[j] goes into pool block blocks[j] of g's layers."""
    if payload.shape[1] != block_nbytes(kv_caches):
        raise ValueError(f"KV blocks of {payload.shape[1]} bytes for a pool whose blocks hold {block_nbytes(kv_caches)}")
    runs = {g: _runs(rows, blocks) for g, (rows, blocks) in dest.items()}
    offset = 0
    for layer, g in zip(kv_caches, layer_groups, strict=True):
        for t in _block_tensors(layer):
            rows = _rows(t)
            n = rows.shape[1]
            for r, b, k in runs.get(g, ()):
                _copy(rows[b : b + k], payload[r : r + k, offset : offset + n])
            offset += n


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """On the CPU through numpy: one thread, the GIL released, where torch's copy would take the
    intra-op team the step's kernels use (a disk-tier copy runs beside a step)."""
    if dst.device.type == "cpu" and src.device.type == "cpu":
        dst.numpy()[...] = src.numpy()
    else:
        dst.copy_(src)


def _runs(rows, blocks) -> list[tuple[int, int, int]]:  # noqa: ANN001 - sequences of ints
    """(row, block, length) of each run in which both go up by one: one strided copy per run (a
    fresh pool hands out consecutive blocks), where torch's index_copy_ goes element by element."""
    runs: list[tuple[int, int, int]] = []
    for r, b in zip(rows, blocks, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == r and runs[-1][1] + runs[-1][2] == b:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((r, b, 1))
    return runs
