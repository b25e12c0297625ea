"""Device and dtype choice, and sizing the KV pool from memory."""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from app.engine.types.engine_config import EngineConfig
from app.engine.types.errors import LocalbatchError
from app.kernels import cpu_build, cpu_qgemm, triton_available

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


@dataclass(frozen=True)
class DeviceSetup:
    device: torch.device
    dtype: torch.dtype
    note: str | None = None  # said once to the user, e.g. a CPU fallback

    @property
    def backend(self) -> str:
        """Which kernels compute, for people: chosen once with the device and dtype."""
        if self.device.type == "cuda":
            return "Triton kernels"
        if self.dtype != torch.float32:
            return f"torch kernels: {str(self.dtype).removeprefix('torch.')} compute"
        if cpu_qgemm.enabled():
            return f"C kernels ({cpu_qgemm.isa()})"
        reason = cpu_build.library().reason or f"{cpu_qgemm.ENABLE_ENV}=0"
        return f"torch kernels: {reason}"


def resolve_device(device: str = "auto", dtype: str = "auto") -> DeviceSetup:
    note = None
    if device not in ("auto", "cpu", "cuda"):
        raise LocalbatchError(f"unknown device {device!r} (choose auto, cpu or cuda)")
    if device in ("auto", "cuda") and not triton_available():
        if device == "cuda":
            note = "CUDA (or Triton) is not available: running on the CPU"
            log.warning(note)
        device = "cpu"
    elif device == "auto":
        device = "cuda"
    if dtype == "auto":
        resolved = torch.bfloat16 if device == "cuda" else cpu_auto_dtype()
    elif dtype in _DTYPES:
        resolved = _DTYPES[dtype]
    else:
        raise LocalbatchError(f"unknown dtype {dtype!r} (choose auto, float32, bfloat16 or float16)")
    return DeviceSetup(torch.device(device), resolved, note)


def cpu_auto_dtype() -> torch.dtype:
    """fp32 wherever the C kernels build (`cpu_qgemm`: AVX2, FMA, F16C and a C compiler): they keep
    the GGUF's 4/5/8-bit groups and beat torch's bf16 int4/int8 path against llama.cpp
    (docs/benchmarks.md). Otherwise bf16 where it measures faster than fp32."""
    if cpu_qgemm.enabled():
        return torch.float32
    return torch.bfloat16 if cpu_bf16_is_faster() else torch.float32


@functools.lru_cache(maxsize=1)
def cpu_bf16_is_faster() -> bool:
    """Serving dtype on the CPU, picked by measurement: bf16 GEMMs are faster than fp32 where the
    CPU has bf16 dot products (AVX512-BF16 / AMX) and slower where it emulates them. Decode is
    weight-bandwidth bound, so the probe is a skinny matmul, cheap at start. An x86 CPU that lists
    neither AVX512-BF16 nor AMX-BF16 emulates bf16 whatever a probe on a busy machine measured (a
    neighbour's load can make bf16 win a probe it would lose)."""
    flags = cpu_build.cpu_flags()
    if "avx2" in flags and not flags & {"avx512_bf16", "amx_bf16"}:
        return False
    w = torch.randn(4096, 1024)
    x = torch.randn(8, 1024)

    def best(a: torch.Tensor, b: torch.Tensor) -> float:
        times = []
        for _ in range(5):
            t = time.perf_counter()
            a @ b.T
            times.append(time.perf_counter() - t)
        return min(times)

    return best(x.bfloat16(), w.bfloat16()) < 0.8 * best(x, w)


def available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def kv_pool_blocks(cfg: EngineConfig, setup: DeviceSetup, bytes_per_token: int, warmup: Callable[[], None],
                   max_needed: int | None = None) -> int:
    """Blocks in the pool: `kv_cache_blocks` if given; on CUDA, what `gpu_memory_utilization` of the
    card leaves after the weights and one warm-up forward; on CPU, `kv_cache_bytes`, by default
    what `max_needed` blocks take (every sequence at the full context) capped by 25% of the
    available RAM."""
    block_bytes = bytes_per_token * cfg.block_size
    if cfg.kv_cache_blocks is not None:
        return cfg.kv_cache_blocks
    if setup.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        warmup()
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        used_by_others = total - free - torch.cuda.memory_reserved()
        peak = torch.cuda.max_memory_allocated()
        budget = int(total * cfg.gpu_memory_utilization) - used_by_others - peak
    elif cfg.kv_cache_bytes is not None:
        budget = cfg.kv_cache_bytes
    else:
        budget = available_ram_bytes() // 4
        if max_needed is not None:
            budget = min(budget, max_needed * block_bytes)
    blocks = budget // block_bytes
    if blocks < 1:
        raise LocalbatchError(
            f"no memory left for the KV cache (budget {budget / 2**20:.0f} MiB, one block needs "
            f"{block_bytes / 2**20:.2f} MiB); lower the model size or raise the KV budget"
        )
    return int(blocks)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.lru_cache(maxsize=None)
def copy_bandwidth(device: torch.device, nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Bytes/s of a plain copy on `device`, counting the read and the write: the memory speed a
    decode step (which streams every weight once) can at best approach. Measured once per process
    and device: every engine start asked again, a 256 MB allocation and five copies each time."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        t = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * src.element_size() / best


@functools.lru_cache(maxsize=None)
def memory_bandwidth(device: torch.device) -> float:
    """Bytes/s a decode step's stream of weights can at best reach on `device`: the copy's rate,
    or on a CPU whose GEMMs run the C kernels their read loop's (two prefetched streams a thread,
    the step's threads) where that is faster, as it is wherever plain loads leave bandwidth unused."""
    from app.kernels import cpu_qgemm  # where the GEMMs are off the library is not built for this
    from app.kernels.cpu_memory import read_bandwidth

    copy = copy_bandwidth(device)
    if device.type != "cpu" or not cpu_qgemm.enabled():
        return copy
    return max(copy, read_bandwidth(torch.get_num_threads()) or 0.0)
