"""What the engine hands back: finished outputs (offline `LLM.generate`), stream deltas
(`AsyncEngine.stream`) and stats snapshots (`AsyncEngine.stats`, polled by the UI and /metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# One position's top-k distribution: {token_id: logprob}.
TopLogprobs = dict[int, float]


@dataclass
class RequestOutput:
    """A finished request, as returned by `LLM.generate`."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    prompt_logprobs: list[TopLogprobs | None] | None = None
    logprobs: list[TopLogprobs] | None = None  # per sampled token (sampled token always included)
    error: str | None = None


@dataclass
class StreamDelta:
    """One step's worth of new output for one request. The last delta has `finish_reason` set."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TopLogprobs] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # total so far, including this delta
    error: str | None = None  # set with finish_reason="error"
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (0 until admitted)
    num_disk_cached_tokens: int = 0  # of those, read from the KV disk tier

    def merged(self, later: StreamDelta) -> StreamDelta:
        """This delta followed by `later` (of the same request) as one."""
        logprobs = None
        if self.logprobs is not None or later.logprobs is not None:
            logprobs = [*(self.logprobs or ()), *(later.logprobs or ())]
        return StreamDelta(self.request_id, self.text + later.text, self.token_ids + later.token_ids,
                           later.finish_reason, logprobs, later.num_prompt_tokens or self.num_prompt_tokens,
                           later.num_output_tokens, later.error,
                           later.num_cached_tokens or self.num_cached_tokens,
                           later.num_disk_cached_tokens or self.num_disk_cached_tokens)


@dataclass(frozen=True, kw_only=True)  # nine fields: positional calls were unreadable
class RequestStats:
    request_id: str
    status: str  # "waiting" | "prefill" | "decode"
    num_prompt_tokens: int
    num_output_tokens: int
    num_blocks: int
    num_cached_tokens: int  # prompt tokens served by the prefix cache
    ttft_s: float | None  # time to first token
    itl_s: float | None  # mean inter-token latency so far
    tokens_per_s: float | None  # this request's decode rate
    num_shared_blocks: int = 0  # of its blocks, those another live request holds too (a forked chat, n > 1)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (a prompt being read: how far it is)
    num_disk_cached_tokens: int = 0  # of num_cached_tokens, read from the KV disk tier


@dataclass(frozen=True)
class SpecStats:
    """Speculative decoding, as the panels and /metrics show it."""

    method: str  # "ngram" or "draft"
    draft_model: str  # the draft model's name; "" for ngram
    enabled: bool  # the app's toggle
    num_draft_tokens: int  # drafted since start
    num_accepted_tokens: int  # of those, kept
    acceptance_rate: float  # recent: kept / drafted
    tokens_per_step: float  # recent: tokens a speculating sequence gains per step (1 + kept)


@dataclass(frozen=True, kw_only=True)
class DiskTierStats:
    """The KV disk tier (prefix-cache blocks kept in files), since start."""

    enabled: bool
    reason: str = ""  # why it is off ("" while on)
    directory: str = ""
    budget_bytes: int = 0
    bytes_on_disk: int = 0  # this directory's block files, as last seen (other processes write too)
    num_files: int = 0
    num_blocks_read: int = 0  # disk hits: blocks read back into the pool
    num_tokens_restored: int = 0  # prompt tokens admitted from those blocks instead of recomputed
    bytes_read: int = 0
    num_blocks_written: int = 0
    bytes_written: int = 0
    num_blocks_dropped: int = 0  # not written: the write queue was full
    num_files_rejected: int = 0  # truncated, corrupt or another model's: removed, never used
    num_files_evicted: int = 0  # removed for the budget, least recently used first


# Why waiting requests wait, as a step's admission found: no free KV blocks, max_num_seqs running,
# or the step's tokens went to prompts ahead of them.
WaitingFor = Literal["kv", "seqs", "turn"]


@dataclass(frozen=True)
class EngineStats:
    """Immutable snapshot of the engine, cheap to take (the UI polls it every panel refresh)."""

    num_running: int = 0
    num_waiting: int = 0
    waiting_for: WaitingFor | None = None  # None: nothing waits, or unknown (a remote backend)
    num_blocks_total: int = 0
    num_blocks_used: int = 0  # held by live requests
    num_blocks_cached_free: int = 0  # free but still holding a reusable prefix
    block_size: int = 16
    kv_bytes_per_token: int = 0
    prefix_cache_hit_rate: float = 0.0  # cached prompt tokens / prompt tokens, since start
    prefill_tokens_per_s: float = 0.0  # recent window
    decode_tokens_per_s: float = 0.0  # recent window
    last_batch_size: int = 0  # sequences in the last step
    last_num_tokens: int = 0  # tokens in the last step
    last_step_time_s: float = 0.0
    num_steps: int = 0
    # Where a client's per-token work shows: the time in steps, and the time between a step that
    # left requests unfinished and the next one (hand-offs to the event loops, the step loop).
    total_step_time_s: float = 0.0
    total_step_gap_s: float = 0.0
    num_step_gaps: int = 0
    num_preemptions: int = 0
    total_prompt_tokens: int = 0
    total_output_tokens: int = 0
    # Why N streams cost little more than one: a step reads every weight once, whatever its batch.
    weight_bytes_per_step: int = 0  # 0: unknown (a remote backend)
    last_kv_bytes_read: int = 0  # K/V bytes the last step's attention read
    memory_bandwidth: float = 0.0  # bytes/s the engine's device can stream at best, measured at start
    num_blocks_shared: int = 0  # distinct blocks held by two or more live requests (counted once in num_blocks_used)
    # KV memory with a hybrid cache (sliding-window layers keep only their window): a token costs
    # kv_bytes_per_token while it is inside the windows, then only the full-attention layers' bytes.
    kv_cache_dtype: str = ""  # e.g. "bfloat16", "int8"; "" unknown
    kv_bytes_per_token_past_window: int = 0  # 0: no sliding-window layers (or unknown)
    kv_cache_tokens: int = 0  # tokens the pool holds if every sequence stays inside its windows; 0 unknown
    num_tokens_fit: int | None = None  # more tokens the free blocks hold at the running mix's cost; None unknown
    requests: tuple[RequestStats, ...] = field(default_factory=tuple)
    speculative: SpecStats | None = None  # None: speculative decoding is not configured
    kv_disk: DiskTierStats | None = None  # None: unknown (a remote backend)
