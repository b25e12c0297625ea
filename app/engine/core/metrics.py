"""Step-level counters and the immutable stats snapshot the UI and /metrics read."""

from __future__ import annotations

import time
from collections import deque

from app.engine.core.block_manager import BlockManager
from app.engine.core.outputs import EngineStats, RequestStats
from app.engine.core.scheduler import ScheduledBatch, Scheduler
from app.engine.core.sequence import Sequence, SequenceStatus

WINDOW_S = 2.0  # tokens/s are averaged over the steps of the last two seconds


class EngineMetrics:
    def __init__(self, kv_bytes_per_token: int) -> None:
        self.kv_bytes_per_token = kv_bytes_per_token
        self.window: deque[tuple[float, float, int, int]] = deque()  # (end time, duration, prefill, decode)
        self.num_steps = 0
        self.total_prompt_tokens = 0
        self.total_output_tokens = 0
        self.last = (0, 0, 0.0)  # batch size, tokens, step time

    def record_step(self, batch: ScheduledBatch, num_sampled: int, duration: float) -> None:
        now = time.monotonic()
        decode = sum(1 for s, n in zip(batch.seqs, batch.num_tokens) if n == 1 and s.num_output_tokens > 0)
        prefill = batch.total_tokens - decode
        self.window.append((now, duration, prefill, decode))
        while self.window and now - self.window[0][0] > WINDOW_S:
            self.window.popleft()
        self.num_steps += 1
        self.total_prompt_tokens += prefill
        self.total_output_tokens += num_sampled
        self.last = (len(batch), batch.total_tokens, duration)

    def rates(self) -> tuple[float, float]:
        if not self.window:
            return 0.0, 0.0
        # Span from the start of the oldest step in the window, so idle gaps lower the rate.
        span = max(time.monotonic() - (self.window[0][0] - self.window[0][1]), 1e-6)
        return sum(w[2] for w in self.window) / span, sum(w[3] for w in self.window) / span

    def snapshot(self, sched: Scheduler, bm: BlockManager) -> EngineStats:
        prefill_rate, decode_rate = self.rates()
        batch_size, num_tokens, step_time = self.last
        seqs = list(sched.running) + list(sched.waiting)
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_blocks_total=bm.num_blocks,
            num_blocks_used=bm.num_used_blocks,
            num_blocks_cached_free=bm.num_cached_free_blocks,
            block_size=bm.block_size,
            kv_bytes_per_token=self.kv_bytes_per_token,
            prefix_cache_hit_rate=bm.hit_rate,
            prefill_tokens_per_s=prefill_rate,
            decode_tokens_per_s=decode_rate,
            last_batch_size=batch_size,
            last_num_tokens=num_tokens,
            last_step_time_s=step_time,
            num_steps=self.num_steps,
            num_preemptions=sched.num_preemptions,
            total_prompt_tokens=self.total_prompt_tokens,
            total_output_tokens=self.total_output_tokens,
            requests=tuple(request_stats(s) for s in seqs),
        )


def request_stats(seq: Sequence) -> RequestStats:
    if seq.status is SequenceStatus.WAITING:
        status = "waiting"
    else:
        status = "decode" if seq.num_output_tokens else "prefill"
    ttft = seq.first_token_time - seq.arrival_time if seq.first_token_time else None
    itl = rate = None
    if seq.first_token_time and seq.last_token_time and seq.num_output_tokens > 1:
        itl = (seq.last_token_time - seq.first_token_time) / (seq.num_output_tokens - 1)
        rate = 1.0 / itl if itl > 0 else None
    return RequestStats(
        request_id=seq.request_id,
        status=status,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_output_tokens=seq.num_output_tokens,
        num_blocks=len(seq.block_table),
        num_cached_tokens=seq.num_cached_tokens,
        ttft_s=ttft,
        itl_s=itl,
        tokens_per_s=rate,
    )
