"""Which sequences run this step, and how many tokens each.

Policy (Sarathi / vLLM V1): running decodes first, one token each; then prompts, in chunks that fill
what is left of `max_num_batched_tokens`: short ones (at most `long_prefill_token_threshold` tokens
left to compute, vLLM's name) before long ones, each kind running prefills first, then newly admitted
ones. So a chat's 30-token prompt is read in the next step even while editors' 2,000-token files
are being read, instead of waiting behind them in the queue. A decode
that speculates takes 1 + k tokens (its verify positions) when the blocks for them are free. A
waiting request is admitted only when blocks for its next chunk are free (backpressure). A decode that
needs a block when none is free preempts the most recently admitted sequence, which gives its
blocks back and goes to the front of the waiting queue to be recomputed later. A prompt whose next
block another running sequence is still computing waits until it is cached, then shares it.

The scheduler owns every request's state: it is the only writer of a sequence's status, computed
tokens, output tokens, logprobs, drafts and finish reason. `schedule()` decides the step (drafts
included); `update_from_output()` applies what the runner computed: the new tokens, the accepted
drafts, the computed-token counts, the stops (asking the output processor, which keeps the text),
and gives back the blocks of the sequences that finished. The block manager writes only block
tables; the speculator and the output processor return what they found. It also owns the prefill
budget (core/step_budget.py), which caps prompt tokens beside decodes: the engine reports each
step's measured time through `observe_step()`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING

from app.engine.core.block_manager import BlockManager
from app.engine.core.output_processor import OutputProcessor
from app.engine.core.sequence import Sequence, SequenceStatus
from app.engine.core.step_budget import PrefillBudget
from app.engine.types.batch import ScheduledBatch
from app.engine.types.errors import QueueFullError, RequestError
from app.engine.types.outputs import TopLogprobs, WaitingFor

if TYPE_CHECKING:
    from app.engine.core.speculator import Speculator
    from app.engine.runtime.model_runner import StepOutput


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_waiting: int = 256
    # A prompt with more tokens than this left to compute is long: short ones go first (0: all alike).
    long_prefill_token_threshold: int = 0


# Waiting requests a step looks through for short prompts: each look hashes the prompt for the
# prefix cache, so a long queue costs a bounded amount per step.
SHORT_LOOKAHEAD = 16

# (decoding sequence, decodes this step) -> draft slots to reserve for it: the speculator's lookahead
Lookahead = Callable[[Sequence, int], int]


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, speculator: Speculator | None = None,
                 prefill_budget: PrefillBudget | None = None, outputs: OutputProcessor | None = None) -> None:
        self.config = config
        self.bm = block_manager
        self.speculator = speculator
        self.lookahead: Lookahead | None = speculator.lookahead if speculator is not None else None
        self.prefill_budget = prefill_budget  # prompt tokens beside decodes, learned from step times
        self.outputs = outputs if outputs is not None else OutputProcessor(None)
        self.requests: dict[str, Sequence] = {}  # every unfinished request, by id
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last one is preempted first
        self.num_preemptions = 0
        self.waiting_for: WaitingFor | None = None  # why the last step left requests waiting

    def add(self, seq: Sequence) -> None:
        """Queue a new request. Raises RequestError (its id is in use) or QueueFullError."""
        if seq.request_id in self.requests:
            raise RequestError(f"request id {seq.request_id!r} is already in use", param="request_id")
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(
                f"the waiting queue is full ({self.config.max_waiting} requests); retry when requests finish"
            )
        self.waiting.append(seq)
        self.requests[seq.request_id] = seq
        self.outputs.add(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        self.waiting_for = None
        self.bm.reap_reads()
        decodes = [s for s in self.running if s.is_decoding]
        prefills = [s for s in self.running if not s.is_decoding]
        budget = self._schedule_running(batch, decodes, budget, len(decodes))
        for long in (False, True):
            if self.prefill_budget is not None and batch.seqs:
                # Replies (or short prompts, soon replies) are waiting on this step: what is left
                # of the prompt-token cap beside them.
                decode_tokens = sum(n for s, n in zip(batch.seqs, batch.num_tokens, strict=True) if s.is_decoding)
                prompt_tokens = batch.total_tokens - decode_tokens
                cap = self.prefill_budget.cap(decode_tokens, len(batch.seqs))
                budget = min(budget, max(0, cap - prompt_tokens))
            running = [s for s in prefills if self._is_long(s.num_uncomputed_tokens) == long]
            budget = self._schedule_running(batch, running, budget, len(decodes))
            if not batch.preempted:
                budget = self._admit(batch, budget, long)
        if self.waiting and self.waiting_for is None:
            self.waiting_for = "kv" if batch.preempted else "turn"
        # Counted at the end: a prompt's room can preempt a decode scheduled before it.
        batch.num_decode_tokens = sum(n for s, n in zip(batch.seqs, batch.num_tokens, strict=True) if s.is_decoding)
        if self.speculator is not None:
            self._add_drafts(batch)
        return batch

    def _add_drafts(self, batch: ScheduledBatch) -> None:
        """The speculator's drafts for the slots reserved; a decode drafted fewer computes fewer."""
        for draft in self.speculator.propose(batch):
            seq = batch.seqs[draft.index]
            if draft.num_draft_computed is not None:
                seq.num_draft_computed = draft.num_draft_computed
            seq.spec_token_ids = draft.token_ids
            batch.num_tokens[draft.index] = 1 + len(draft.token_ids)

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
        self._free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def _is_long(self, num_tokens: int) -> bool:
        threshold = self.config.long_prefill_token_threshold
        return threshold > 0 and num_tokens > threshold

    def _admit(self, batch: ScheduledBatch, budget: int, long: bool) -> int:
        """Admit waiting requests in order while the budget lasts: the short ones (`long` False,
        passing long ones), then all of them. Returns what is left of the budget."""
        queue = list(self.waiting) if long else list(islice(self.waiting, SHORT_LOOKAHEAD))
        for seq in queue:
            if len(self.running) >= self.config.max_num_seqs:
                self.waiting_for = "seqs"
                break
            if budget == 0:
                break
            if not self.bm.restore_ready(seq):
                continue  # blocks of its prefix are being read from disk: the others step meanwhile
            cached = self.bm.find_cached_prefix(seq)
            uncached = seq.num_tokens - cached.num_blocks * self.bm.block_size
            if not long and self._is_long(uncached):
                continue  # its turn comes after the short ones
            if self._prefix_in_flight(seq, cached.num_blocks):
                break  # a step or two later those blocks are cached: shared, not computed twice
            n = min(uncached, budget)
            if not self.bm.can_admit(seq, cached, n):
                self.waiting_for = "kv"
                break  # backpressure: wait for blocks to come back
            self.waiting.remove(seq)
            seq.num_computed_tokens = seq.num_cached_tokens = self.bm.admit(seq, cached)
            self.bm.allocate(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, n)
            budget -= n
        return budget

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

    # ---- after the step ------------------------------------------------------------------------
    def observe_step(self, batch: ScheduledBatch, seconds: float) -> None:
        """A step's measured time, for the prefill budget's step-time model."""
        if self.prefill_budget is not None:
            self.prefill_budget.observe(batch.num_decode_tokens, batch.total_tokens - batch.num_decode_tokens, seconds)

    def update_from_output(self, batch: ScheduledBatch, output: StepOutput) -> list[Sequence]:
        """Apply a step's output to its sequences: prompt logprobs, new tokens (a speculating
        sequence's kept drafts and one more) and their logprobs, computed tokens, stops; finished
        sequences give their blocks back. Returns the sequences with news for their streams (new
        tokens, or the end), in batch order."""
        for seq in batch.seqs:  # failed even alone: they end first, as they did when their retry failed
            if seq.request_id in output.errors:
                seq.error = output.errors[seq.request_id]
                self.finish(seq, "error")
        updated = []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            if seq.is_finished:
                updated.append(seq)
                continue
            seq.prompt_logprobs.extend(output.prompt_logprobs.get(seq.request_id, ()))
            tokens = output.sampled.get(seq.request_id)
            if tokens is None:  # mid-prompt chunk
                seq.num_computed_tokens += n
                self._commit_blocks(seq)
                continue
            drafts = len(seq.spec_token_ids)
            seq.num_computed_tokens += n - drafts + len(tokens) - 1  # the kept drafts' KV is the real tokens'
            self._append_tokens(seq, tokens, output.logprobs.get(seq.request_id))
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)  # a stop among the kept drafts
            if drafts:
                self.speculator.on_verified(seq, drafts, len(tokens) - 1)
                seq.spec_token_ids = []
                seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed_tokens)
            if self.speculator is not None:  # slots reserved for drafts that were rejected or never drafted
                self.bm.free_rejected_blocks(seq)
            self._commit_blocks(seq)
            if seq.finish_reason is not None:
                self.finish(seq, seq.finish_reason)
            updated.append(seq)
        return updated

    def _append_tokens(self, seq: Sequence, tokens: list[int], logprobs: list[TopLogprobs] | None) -> None:
        """Append new tokens, with their logprobs if asked, up to the first that finishes the
        request (then its finish reason is set)."""
        for i, token in enumerate(tokens):
            seq.append_token(token)
            if logprobs is not None:
                seq.logprobs.append(logprobs[i])
            if seq.grammar is not None and not seq.grammar.accept(token):
                # The mask allows only tokens the grammar accepts, so this means a grammar no token of
                # the vocabulary can continue: end the request rather than stream output that breaks it.
                seq.error = f"structured output: no token of this vocabulary continues the grammar (sampled {token})"
                seq.finish_reason = "error"
            else:
                seq.finish_reason = self.outputs.check_token(seq, token)
            if seq.finish_reason is not None:
                break

    def _commit_blocks(self, seq: Sequence) -> None:
        self.bm.cache_full_blocks(seq)
        self.bm.free_skipped_blocks(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """End an unfinished request (None: no such request)."""
        seq = self.requests.get(request_id)
        if seq is not None:
            self.finish(seq, "abort")
        return seq

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence wherever it is (running or waiting) and return its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self.bm.drop_read(seq)
        self._free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason
        seq.grammar = None  # a finished request's matcher is not needed again
        self.requests.pop(seq.request_id, None)

    def _free(self, seq: Sequence) -> None:
        """Give back a sequence's blocks: none of its tokens (nor drafts) has KV any more."""
        self.bm.free_seq(seq)
        seq.num_computed_tokens = 0
        seq.num_draft_computed = 0
