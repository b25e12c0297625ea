"""Which sequences run this step, and how many tokens each.

Policy (Sarathi / vLLM V1): running decodes first, one token each; then running prefills, then
newly admitted prompts, in chunks that fill what is left of `max_num_batched_tokens`. A decode
that speculates takes 1 + k tokens (its verify positions) when the blocks for them are free. A
waiting request is admitted only when blocks for its next chunk are free (backpressure). A decode that
needs a block when none is free preempts the most recently admitted sequence, which gives its
blocks back and goes to the front of the waiting queue to be recomputed later. A prompt whose next
block another running sequence is still computing waits until it is cached, then shares it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from app.engine.core.block_manager import BlockManager
from app.engine.core.sequence import Sequence, SequenceStatus
from app.engine.types.batch import ScheduledBatch
from app.engine.types.errors import QueueFullError


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_waiting: int = 256


# (decoding sequence, decodes this step) -> draft slots to reserve for it: the speculator's lookahead
Lookahead = Callable[[Sequence, int], int]
# decodes this step -> prompt tokens the step may carry beside them (step_budget.PrefillBudget.cap)
PrefillCap = Callable[[int], int]


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, lookahead: Lookahead | None = None,
                 prefill_cap: PrefillCap | None = None) -> None:
        self.config = config
        self.bm = block_manager
        self.lookahead = lookahead
        self.prefill_cap = prefill_cap
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last one is preempted first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(
                f"the waiting queue is full ({self.config.max_waiting} requests); retry when requests finish"
            )
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        decodes = [s for s in self.running if s.is_decoding]
        prefills = [s for s in self.running if not s.is_decoding]
        budget = self._schedule_running(batch, decodes, budget, len(decodes))
        prompt_budget = budget
        if self.prefill_cap is not None and batch.seqs:  # replies are waiting on this step
            prompt_budget = min(budget, self.prefill_cap(len(batch.seqs)))
        prompt_budget = self._schedule_running(batch, prefills, prompt_budget, len(decodes))
        if not batch.preempted:
            self._admit(batch, prompt_budget)
        # Counted at the end: a prompt's room can preempt a decode scheduled before it.
        batch.num_decode_tokens = sum(n for s, n in zip(batch.seqs, batch.num_tokens, strict=True) if s.is_decoding)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, seqs: list[Sequence], budget: int, num_decodes: int) -> int:
        """Schedule running sequences in order while the budget lasts; returns what is left of it."""
        for seq in seqs:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this step
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            if self._make_room(seq, n, batch):
                n += self._draft_slots(seq, num_decodes, budget - n)
                self.bm.allocate(seq, n)
                batch.add(seq, n)
                budget -= n
        return budget

    def _draft_slots(self, seq: Sequence, num_decodes: int, budget: int) -> int:
        """Slots for a decode's drafts: never at the cost of a preemption or another's budget share."""
        if self.lookahead is None or not seq.is_decoding:
            return 0
        k = min(self.lookahead(seq, num_decodes), budget)
        while k and not self.bm.can_allocate(seq, 1 + k):
            k -= 1
        return k

    def _make_room(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Preempt from the back of the running list until `seq` fits; False if `seq` itself went."""
        while not self.bm.can_allocate(seq, n):
            victim = self.running[-1]
            self._preempt(victim, batch)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        if seq in batch.seqs:
            # Already scheduled this step with blocks allocated: unschedule it first.
            i = batch.seqs.index(seq)
            del batch.seqs[i], batch.num_tokens[i]
        self.running.remove(seq)
        self.bm.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            cached = self.bm.find_cached_prefix(seq)
            if self._prefix_in_flight(seq, cached.num_blocks):
                break  # a step or two later those blocks are cached: shared, not computed twice
            n = min(seq.num_tokens - cached.num_blocks * self.bm.block_size, budget)
            if not self.bm.can_admit(seq, cached, n):
                break  # backpressure: wait for blocks to come back
            self.waiting.popleft()
            self.bm.admit(seq, cached)
            self.bm.allocate(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, n)
            budget -= n

    def _prefix_in_flight(self, seq: Sequence, num_cached_blocks: int) -> bool:
        """Whether a running sequence is still computing `seq`'s next full prompt block (n > 1
        choices, a forked chat sent while its parent's prompt is in prefill): admitted now, `seq`
        would compute the same KV again instead of sharing the blocks."""
        if not self.bm.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return False
        end = (num_cached_blocks + 1) * self.bm.block_size
        if end > seq.num_tokens - 1:  # no further full block the cache could serve
            return False
        prefix = seq.token_ids[:end]
        return any(r.num_computed_tokens < end <= r.num_tokens and r.token_ids[:end] == prefix for r in self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence wherever it is (running or waiting) and return its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free_seq(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason
