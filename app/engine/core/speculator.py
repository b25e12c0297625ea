"""Speculative decoding's bookkeeping: which decodes speculate and how far, their drafts (prompt
lookup or a draft model), and the acceptance counters the panels and /metrics show.

A step with speculation: the scheduler reserves `lookahead()` extra slots for each eligible decode,
`propose()` drafts tokens for them (fewer when prompt lookup finds fewer) and the scheduler puts
them in the batch, the runner verifies all 1 + k positions in the same packed forward as everything
else, and the scheduler keeps what was accepted and reports it to `on_verified()`. Rejected drafts'
blocks go back to the pool (`BlockManager.free_rejected_blocks`). The speculator writes no sequence.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from weakref import WeakKeyDictionary

from app.engine.core.ngram_proposer import NgramProposer
from app.engine.core.sequence import Sequence
from app.engine.runtime.draft_model import DraftModel, DraftRequest
from app.engine.types.batch import ScheduledBatch
from app.engine.types.outputs import SpecStats
from app.engine.types.speculative_config import SpeculativeConfig

_EMA = 0.05  # weight of one step in the recent acceptance figures (about the last 20 steps)
_COST_EMA = 0.2  # weight of one step in the measured step costs
_DECAY = 0.95  # per step, a sequence's acceptance record fades: an old miss stops ruling out drafting
# The record starts as if 1.5 drafts had been kept and 0.5 rejected (a rate of 0.75): every
# sequence tries drafting, and one that stopped tries again once its misses have faded (~14 steps).
_PRIOR_KEPT, _PRIOR_REJECTED = 1.5, 0.5
# Until measured: a verify row costs this share of a one-sequence step (a sizeable share on a
# CPU, little on a GPU); a draft model's round 0.35.
_PRIOR_ROW_COST = 0.25
_PRIOR_ROUND_COST = 0.35


@dataclass
class Draft:
    """Tokens proposed for the sequence at `index` in the batch."""

    index: int
    token_ids: list[int]
    num_draft_computed: int | None = None  # its tokens with KV in the draft model's pool now; None: unchanged


class _Acceptance:
    """A sequence's recent drafts, as a per-token acceptance probability (kept tokens run until
    the first rejection), both counts fading each step toward the prior."""

    __slots__ = ("kept", "rejected")

    def __init__(self) -> None:
        self.kept = self.rejected = 0.0

    def rate(self) -> float:
        self.kept *= _DECAY
        self.rejected *= _DECAY
        return (self.kept + _PRIOR_KEPT) / (self.kept + self.rejected + _PRIOR_KEPT + _PRIOR_REJECTED)


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft: DraftModel | None = None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.draft = draft
        lookup = draft is None or config.prompt_lookup
        self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max) if lookup else None
        self.enabled = True  # the app's toggle: read once per step by the step thread
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_spec_steps = 0  # sequence-steps that verified drafts
        self.propose_s = 0.0  # time spent drafting (prompt lookup or the draft model's forwards)
        self.last_propose_s = 0.0  # the same, in the last step
        self._acceptance = 0.0
        self._tokens_per_step = 1.0
        self._records: WeakKeyDictionary[Sequence, _Acceptance] = WeakKeyDictionary()
        # Measured costs, seconds: a step without drafts by its sequence count, one verify row, one draft round.
        self._base_step: dict[int, float] = {}
        self._row_s: float | None = None
        self._round_s: float | None = None

    def lookahead(self, seq: Sequence, num_decodes: int) -> int:
        """Draft slots to reserve for a decoding `seq` in a step with `num_decodes` decodes.

        Draft i is kept with probability a^i (a: the sequence's acceptance rate) and saves a step's
        share of a token, T/n; it costs a verify row and, with a draft model, a share of a round.
        So the sequence drafts while a^i > (round + n * row) / T: long runs when its drafts have
        been landing, none for a batch so big that rows cost more than they save. 0 also when
        speculation is off, or the request needs what verification skips (a grammar, penalties
        that depend on each token)."""
        if not self.enabled or num_decodes > self.config.disable_by_batch_size or not _eligible(seq):
            return 0
        room = min(seq.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens)
        k = min(self.config.num_speculative_tokens, room)
        record = self._records.get(seq)
        if record is None:
            record = self._records[seq] = _Acceptance()
        rate, threshold = record.rate(), self._threshold(num_decodes)
        if k <= 0 or rate <= threshold:
            return 0
        return k if rate >= 0.999 else max(0, min(k, int(math.log(threshold) / math.log(rate))))

    def _threshold(self, n: int) -> float:
        base = self._base_step.get(n) or self._base_step.get(1)
        if base is None:
            return min(0.99, n * _PRIOR_ROW_COST + (_PRIOR_ROUND_COST if self.draft is not None else 0.0))
        row = self._row_s if self._row_s is not None else _PRIOR_ROW_COST * base
        round_s = 0.0 if self.draft is None else (self._round_s if self._round_s is not None else _PRIOR_ROUND_COST * base)
        return min(0.99, max(1e-3, (round_s + n * row) / base))

    def observe(self, batch: ScheduledBatch, duration: float) -> None:
        """A finished step's time: the cost model's measurements (decode-only steps only)."""
        propose_s = self.last_propose_s
        if not batch.seqs or not all(s.num_output_tokens for s in batch.seqs):
            return
        n, rows = len(batch.seqs), batch.total_tokens
        extra = rows - n
        if extra == 0:
            self._base_step[n] = _ema(self._base_step.get(n), duration)
            return
        base = self._base_step.get(n)
        if base is not None:
            self._row_s = _ema(self._row_s, max(0.0, duration - propose_s - base) / extra)
        if self.draft is not None and self.draft.last_round_s is not None:
            self._round_s = _ema(self._round_s, self.draft.last_round_s)

    def propose(self, batch: ScheduledBatch) -> list[Draft]:
        """Drafts for the reserved slots: a sequence drafted fewer gives its slots back to the batch
        (its blocks go back after the step)."""
        self.last_propose_s = 0.0
        chosen = [i for i, (s, n) in enumerate(zip(batch.seqs, batch.num_tokens)) if n > 1 and s.is_decoding]
        if not chosen:
            return []
        start = time.perf_counter()
        seqs = [batch.seqs[i] for i in chosen]
        wanted = [batch.num_tokens[i] - 1 for i in chosen]
        drafts = [Draft(i, self.ngram.propose(s, k) if self.ngram is not None else [])
                  for i, s, k in zip(chosen, seqs, wanted)]
        if self.draft is not None:
            self.draft.last_round_s = None
            # The draft model runs for the sequences prompt lookup found nothing for (all, without it).
            todo = [j for j, d in enumerate(drafts) if not d.token_ids]
            requests = [DraftRequest(seqs[j].token_ids, seqs[j].num_draft_computed, seqs[j].block_table, wanted[j])
                        for j in todo]
            for j, tokens in zip(todo, self.draft.propose(requests) if requests else []):
                drafts[j].token_ids = tokens
                drafts[j].num_draft_computed = seqs[j].num_tokens + len(tokens) - 1
        self.last_propose_s = time.perf_counter() - start
        self.propose_s += self.last_propose_s
        return drafts

    def on_verified(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """Count a verified step of `seq`: `num_accepted` of its `num_drafted` drafts were kept."""
        record = self._records.get(seq)
        if record is not None:
            record.kept += num_accepted
            record.rejected += num_accepted < num_drafted
        self.num_spec_steps += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        self._acceptance += _EMA * (num_accepted / num_drafted - self._acceptance)
        self._tokens_per_step += _EMA * (1 + num_accepted - self._tokens_per_step)

    def stats(self) -> SpecStats:
        method, draft = ("draft", self.config.model) if self.draft is not None else ("ngram", "")
        if self.draft is not None and self.ngram is not None:
            method = "ngram+draft"
        return SpecStats(method, draft or "", self.enabled, self.num_draft_tokens, self.num_accepted_tokens,
                         self._acceptance, self._tokens_per_step)


def _eligible(seq: Sequence) -> bool:
    p = seq.params
    penalties = p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    return seq.grammar is None and not penalties


def _ema(old: float | None, value: float) -> float:
    return value if old is None else old + _COST_EMA * (value - old)
