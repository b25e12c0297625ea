"""Step-level counters and the immutable stats snapshot the UI and /metrics read."""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from app.engine.core.block_manager import BlockManager
from app.engine.core.scheduler import Scheduler
from app.engine.core.sequence import Sequence, SequenceStatus
from app.engine.runtime.device import memory_bandwidth
from app.engine.runtime.kv_pool import kv_sizes
from app.engine.runtime.worker import Worker
from app.engine.types.batch import ScheduledBatch
from app.engine.types.outputs import EngineStats, RequestStats, SpecStats
from app.engine.types.timing import reply_timing

WINDOW_S = 2.0  # tokens/s are averaged over the steps of the last two seconds


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One finished step, as the rate window and the "last step" figures see it."""

    end: float  # time.monotonic() when it finished
    duration_s: float
    batch_size: int  # sequences in the step
    prefill_tokens: int
    decode_tokens: int
    kv_bytes_read: int = 0

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens


@dataclass(frozen=True, slots=True)
class MemoryTraffic:
    """What a step reads from memory: the weights once, and each sequence's K/V."""

    weight_bytes_per_step: Callable[[int], int]  # tokens in the step -> weight bytes read (int8 or bf16 by rows)
    memory_bandwidth: float  # bytes/s, measured on the engine's device (runtime.device.memory_bandwidth)
    kv_bytes_read: Callable[[list[int]], int]  # context lengths -> K/V bytes read


@dataclass(frozen=True, slots=True)
class KVCacheInfo:
    """What a token costs in the pool, for the stats."""

    dtype: str  # the storage dtype's name
    bytes_per_token: int  # every layer
    bytes_per_token_past_window: int  # the full-attention layers only; 0 without sliding-window groups


class EngineMetrics:
    @classmethod
    def of(cls, worker: Worker) -> EngineMetrics:
        """The metrics of an engine on `worker`: what a token costs in its pool, what a step reads."""
        plan = worker.plan
        spec, per_token, cfg = plan.kv_spec, plan.kv_bytes_per_token, plan.model_config
        full_layers = sum(len(g.layers) for g in spec.groups if g.sliding_window is None)
        past_window = per_token * full_layers // cfg.num_layers if spec.is_hybrid else 0
        kv = KVCacheInfo(str(plan.kv_dtype).removeprefix("torch."), per_token, past_window)
        return cls(kv, MemoryTraffic(
            weight_bytes_per_step=worker.model.weight_bytes_per_step,
            memory_bandwidth=memory_bandwidth(plan.setup.device),
            kv_bytes_read=functools.partial(cfg.kv_bytes_read, **kv_sizes(plan.kv_dtype)),
        ))

    def __init__(self, kv: KVCacheInfo, traffic: MemoryTraffic) -> None:
        self.kv = kv
        self.kv_bytes_per_token = kv.bytes_per_token
        self.traffic = traffic
        self.window: deque[StepRecord] = deque()
        self.num_steps = 0
        self.total_prompt_tokens = 0
        self.total_output_tokens = 0
        self.total_step_time_s = 0.0
        self.total_step_gap_s = 0.0
        self.num_step_gaps = 0
        self.last = StepRecord(0.0, 0.0, 0, 0, 0)

    def record_step(self, batch: ScheduledBatch, sampled: dict[str, list[int]], duration: float,
                    gap: float | None = None) -> None:
        """After `Scheduler.update_from_output`. A decode is a sequence that had output before this
        step: its positions (1, or 1 + k verified drafts) are not prefill, and it gained the tokens it
        kept. `gap`: the time since the previous step ended, when that step left requests unfinished."""
        now = time.monotonic()
        decode_positions = decode = 0
        for s, n in zip(batch.seqs, batch.num_tokens):
            new = len(sampled.get(s.request_id, ()))
            if new and s.num_output_tokens > new:
                decode_positions += n
                decode += new
        # After the update: a sequence's computed tokens already include this step's.
        kv_read = self.traffic.kv_bytes_read([s.num_computed_tokens for s in batch.seqs])
        self.last = StepRecord(now, duration, len(batch), batch.total_tokens - decode_positions, decode, kv_read)
        self.window.append(self.last)
        self._prune(now)
        self.num_steps += 1
        self.total_step_time_s += duration
        if gap is not None:
            self.total_step_gap_s += gap
            self.num_step_gaps += 1
        self.total_prompt_tokens += self.last.prefill_tokens
        self.total_output_tokens += sum(len(t) for t in sampled.values())

    def _prune(self, now: float) -> None:
        while self.window and now - self.window[0].end > WINDOW_S:
            self.window.popleft()

    def rates(self) -> tuple[float, float]:
        now = time.monotonic()
        self._prune(now)  # idle too: the rates fall to zero once the last step is old
        if not self.window:
            return 0.0, 0.0
        # Span from the start of the oldest step in the window, so idle gaps lower the rate.
        oldest = self.window[0]
        span = max(now - (oldest.end - oldest.duration_s), 1e-6)
        prefill = sum(step.prefill_tokens for step in self.window)
        return prefill / span, sum(step.decode_tokens for step in self.window) / span

    def snapshot(self, sched: Scheduler, bm: BlockManager, spec: SpecStats | None = None) -> EngineStats:
        prefill_rate, decode_rate = self.rates()
        seqs = list(sched.running) + list(sched.waiting)
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            waiting_for=sched.waiting_for if sched.waiting else None,
            num_blocks_total=bm.num_blocks,
            num_blocks_used=bm.num_used_blocks,
            num_blocks_cached_free=bm.num_cached_free_blocks,
            block_size=bm.block_size,
            kv_bytes_per_token=self.kv_bytes_per_token,
            prefix_cache_hit_rate=bm.hit_rate,
            prefill_tokens_per_s=prefill_rate,
            decode_tokens_per_s=decode_rate,
            last_batch_size=self.last.batch_size,
            last_num_tokens=self.last.num_tokens,
            last_step_time_s=self.last.duration_s,
            num_steps=self.num_steps,
            total_step_time_s=self.total_step_time_s,
            total_step_gap_s=self.total_step_gap_s,
            num_step_gaps=self.num_step_gaps,
            num_preemptions=sched.num_preemptions,
            total_prompt_tokens=self.total_prompt_tokens,
            total_output_tokens=self.total_output_tokens,
            weight_bytes_per_step=self.traffic.weight_bytes_per_step(max(self.last.prefill_tokens + self.last.decode_tokens, 1)),
            last_kv_bytes_read=self.last.kv_bytes_read,
            memory_bandwidth=self.traffic.memory_bandwidth,
            num_blocks_shared=len({b for s in seqs for b in bm.held_blocks(s) if bm.blocks[b].ref_count > 1}),
            kv_cache_dtype=self.kv.dtype,
            kv_bytes_per_token_past_window=self.kv.bytes_per_token_past_window,
            kv_cache_tokens=bm.num_blocks * bm.block_size // bm.spec.num_groups,
            num_tokens_fit=tokens_fit(bm, sched.running),
            requests=tuple(request_stats(s, bm) for s in seqs),
            speculative=spec,
            kv_disk=bm.disk.stats() if bm.disk is not None else None,
        )


def tokens_fit(bm: BlockManager, running: list[Sequence]) -> int:
    """More tokens the free blocks hold if the running sequences grow evenly: each takes a block
    per block_size tokens in every group still growing (a sliding group stops at its window). With
    nothing running, at the cost of a new sequence (every group grows)."""
    spec = bm.spec
    growing = [spec.growing_groups(s.num_computed_tokens) for s in running] or [spec.num_groups]
    per_token_groups = max(sum(growing) / len(growing), 1.0)
    return int(bm.num_free_blocks * bm.block_size / per_token_groups)


def request_stats(seq: Sequence, bm: BlockManager | None = None) -> RequestStats:
    if seq.status is SequenceStatus.WAITING:
        status = "waiting"
    else:
        status = "decode" if seq.num_output_tokens else "prefill"
    timing = reply_timing(seq.arrival_time, seq.first_token_time, seq.last_token_time, seq.num_output_tokens)
    return RequestStats(
        request_id=seq.request_id,
        status=status,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_output_tokens=seq.num_output_tokens,
        num_blocks=sum(1 for _ in BlockManager.held_blocks(seq)),
        num_cached_tokens=seq.num_cached_tokens,
        ttft_s=timing.ttft_s,
        itl_s=timing.itl_s,
        tokens_per_s=timing.tokens_per_s,
        num_shared_blocks=sum(bm.blocks[b].ref_count > 1 for b in bm.held_blocks(seq)) if bm is not None else 0,
        num_computed_tokens=seq.num_computed_tokens,
        num_disk_cached_tokens=seq.num_disk_cached_tokens,
    )
