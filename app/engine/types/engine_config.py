"""Engine settings. The keyword names are vLLM's; the CLI flags are the same names with dashes."""

from __future__ import annotations

from dataclasses import dataclass, fields

from app.engine.types.errors import LocalbatchError
from app.engine.types.speculative_config import SpeculativeConfig

# vLLM's names; "auto" stores K/V in the compute dtype. int8 and fp8_e4m3 keep a per-token,
# per-KV-head scale beside the data (app/kernels/kv_quant.py); fp8_e4m3 is CUDA only.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8_e4m3")
# The KV disk tier's budget in the app and `serve` when none is given (the Python API's default is off).
DEFAULT_KV_DISK_CACHE_BYTES = 4 << 30


@dataclass
class EngineConfig:
    max_num_batched_tokens: int | None = None  # None: 512 on CPU, 8192 on CUDA
    # While replies stream, prompt chunks are sized so that a step stays under this (core/step_budget.py).
    # None: on a CPU 2 decode steps, at least 60 ms; on a GPU off. 0: only max_num_batched_tokens.
    itl_target_ms: float | None = None
    # A prompt with more tokens than this left to read is long: short prompts (a chat's next
    # message) are read before long ones (a pasted file). None: max_num_batched_tokens / 4; 0: in order.
    long_prefill_token_threshold: int | None = None
    max_num_seqs: int = 64
    block_size: int = 16
    kv_cache_bytes: int | None = None  # CPU pool size; None: by need, at most 25% of available RAM
    kv_cache_blocks: int | None = None  # overrides both byte budgets
    max_waiting: int = 256
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None  # None: the model's context length
    enforce_eager: bool = False  # CUDA: run decode steps eagerly instead of replaying CUDA graphs
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    # One block table for all layers, every layer keeping every token (vLLM's flag): turns off the
    # freeing of sliding-window layers' blocks behind their window.
    disable_hybrid_kv_cache_manager: bool = False
    # CPU: pick the thread count (all cores or one) by measuring decode steps, so that a busy
    # neighbour process costs its share of the CPU rather than stalling every barrier. The app and
    # `serve` turn it on; offline runs and benchmarks keep a fixed count.
    adaptive_threads: bool = False
    # CPU: a fixed thread count for the kernels (llama.cpp's -t); overrides adaptive_threads.
    num_threads: int | None = None
    # The KV disk tier under the prefix cache (core/kv_disk_cache.py): full blocks kept in files
    # under this directory (None: the user cache dir's kv-blocks), at most this many bytes, least
    # recently used out first. 0 (the Python API's default): off; the app and serve default to
    # DEFAULT_KV_DISK_CACHE_BYTES.
    kv_disk_cache_dir: str | None = None
    kv_disk_cache_bytes: int = 0
    # Speculative decoding (vLLM's spelling): prompt lookup or a draft model; None: off.
    speculative_config: SpeculativeConfig | dict | str | None = None

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def validate(self) -> None:
        positive = ["max_num_seqs", "block_size", "max_waiting"]
        optional_positive = ["max_num_batched_tokens", "kv_cache_bytes", "kv_cache_blocks", "max_model_len",
                             "num_threads"]
        for name in positive + optional_positive:
            value = getattr(self, name)
            if value is None and name in optional_positive:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LocalbatchError(f"invalid {name}={value!r}: must be a positive integer")
        threshold = self.long_prefill_token_threshold
        if threshold is not None and (not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0):
            raise LocalbatchError(f"invalid long_prefill_token_threshold={threshold!r}: must be an integer >= 0")
        if self.itl_target_ms is not None and (isinstance(self.itl_target_ms, bool)
                                               or not isinstance(self.itl_target_ms, (int, float))
                                               or not 0 <= self.itl_target_ms < float("inf")):
            raise LocalbatchError(f"invalid itl_target_ms={self.itl_target_ms!r}: must be a number of milliseconds >= 0")
        if not isinstance(self.enforce_eager, bool):
            raise LocalbatchError(f"invalid enforce_eager={self.enforce_eager!r}: must be True or False")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise LocalbatchError(
                f"invalid kv_cache_dtype={self.kv_cache_dtype!r}: choose {', '.join(KV_CACHE_DTYPES)}"
            )
        b = self.kv_disk_cache_bytes
        if not isinstance(b, int) or isinstance(b, bool) or b < 0:
            raise LocalbatchError(f"invalid kv_disk_cache_bytes={b!r}: must be an integer >= 0 (0: off)")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise LocalbatchError(f"invalid gpu_memory_utilization={self.gpu_memory_utilization!r}: must be in (0, 1]")
