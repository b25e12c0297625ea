"""Turns a scheduled batch into one flat forward pass and samples its next tokens.

The step's tokens are packed back to back (no padding): prefill chunks of several prompts and
single decode tokens side by side, described by `cu_seqlens_q`, `seq_lens`, `block_table` and
`slot_mapping`. Logits are computed only at `logits_indices`: the last row of each sequence whose
step reaches the end of its tokens, plus every row of a chunk whose prompt logprobs were asked.
A speculating sequence's drafts (`spec_token_ids`) follow its last token as a chunk would: all of
its rows get logits, and the rejection sampler decides which drafts it keeps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from app.engine.runtime.cuda_graphs import DecodeGraphs
from app.engine.runtime.decoder import DecoderLM
from app.engine.runtime.kv_cache_spec import KVCacheSpec, kv_cache_spec
from app.engine.runtime.kv_pool import allocate_kv_caches
from app.engine.runtime.rejection_sampler import verify
from app.engine.runtime.sampler import Sampler, top_logprobs_rows
from app.engine.types.batch import ScheduledBatch, ScheduledSequence
from app.engine.types.outputs import TopLogprobs
from app.kernels import AttentionMetadata

log = logging.getLogger(__name__)

PROMPT_LOGPROB_ROWS = 256


@dataclass
class StepInputs:
    """One step's batch as host tensors (pinned on CUDA, so uploads can be asynchronous). `metas`:
    one AttentionMetadata per KV cache group, sharing `cu_seqlens_q` and `seq_lens`."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metas: list[AttentionMetadata]
    logits_indices: torch.Tensor
    sample_rows: list[int]  # rows in the logits of the sampling sequences: one each, 1 + k if speculating
    sample_seqs: list[ScheduledSequence]
    prompt_rows: list[tuple[ScheduledSequence, int, int, int]]  # (seq, first logits row, first position, count)

    @property
    def meta(self) -> AttentionMetadata:
        return self.metas[0]

    @property
    def is_decode_only(self) -> bool:
        """One token per sequence and every sequence samples: the shape CUDA graphs replay."""
        n = self.input_ids.shape[0]
        return n == self.meta.num_seqs == len(self.sample_seqs) == len(self.sample_rows) and not self.prompt_rows

    def to(self, device: torch.device) -> "StepInputs":
        if device.type == "cpu":
            return self

        def up(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        first = self.meta.to(device, non_blocking=True)
        metas = [first] + [
            AttentionMetadata(first.cu_seqlens_q, first.seq_lens, up(m.block_table), up(m.slot_mapping))
            for m in self.metas[1:]
        ]
        return StepInputs(up(self.input_ids), up(self.positions), metas, up(self.logits_indices),
                          self.sample_rows, self.sample_seqs, self.prompt_rows)


@dataclass
class StepOutput:
    sampled: dict[str, list[int]]  # request_id -> new tokens: one, or a speculating sequence's kept drafts + 1
    logprobs: dict[str, list[TopLogprobs]]  # request_id -> one per new token, where logprobs were asked
    # request_id -> prompt logprobs to append to what the sequence recorded (a None first, for
    # the first prompt token, when it had recorded none)
    prompt_logprobs: dict[str, list[TopLogprobs | None]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # request_id -> why its step failed (it ends)


def slots_of(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """The cache slots of positions [start, end) of a sequence with block table `table`."""
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def padded(tables: list[list[int]]) -> list[list[int]]:
    """Block tables padded with block 0 to the widest (a tensor's rows)."""
    width = max(len(t) for t in tables)
    return [t + [0] * (width - len(t)) for t in tables]


class ModelRunner:
    def __init__(
        self, model: DecoderLM, num_blocks: int, block_size: int, spec: KVCacheSpec | None = None
    ) -> None:
        cfg = model.cfg
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.spec = spec or kv_cache_spec(cfg, block_size, hybrid=False)
        self.layer_groups = [s.group for s in self.spec.layer_slots()]
        # In the dtype the model's kernels were chosen for; int8 / float8_e4m3fn pools come with their
        # scales (KVCacheLayer).
        self.kv_caches = allocate_kv_caches(cfg, num_blocks, block_size, model.kv_dtype, self.device, self.spec)
        self.sampler = Sampler(cfg.vocab_size)
        self.graphs: DecodeGraphs | None = None

    def setup_decode_graphs(self, max_num_seqs: int, max_model_len: int, capture: bool = True) -> None:
        """Run decode-only steps on static buffers bucketed up to `max_num_seqs` sequences and
        `max_model_len` tokens of context, as CUDA graphs if `capture` (else eagerly, with the same
        numbers). A capture failure costs speed, not service: the buckets then run eagerly."""
        self.graphs = DecodeGraphs(
            self.model, self.kv_caches, max_num_seqs, -(-max_model_len // self.block_size), self.layer_groups
        )
        if not capture:
            return
        start, (free_before, _) = time.perf_counter(), torch.cuda.mem_get_info()
        try:
            self.graphs.capture_all()
        except Exception as e:  # noqa: BLE001 - e.g. an op that cannot be captured on this torch
            log.warning("CUDA graph capture failed (%s: %s); decode steps run eagerly", type(e).__name__, e)
            return
        log.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s, %.0f MiB of GPU memory",
                 len(self.graphs.sizes), self.graphs.sizes, time.perf_counter() - start,
                 (free_before - torch.cuda.mem_get_info()[0]) / 2**20)

    def run(self, batch: ScheduledBatch, on_launched: Callable[[], None] | None = None) -> StepOutput:
        """The step's forward and sampling. `on_launched` is called once the forward is queued and
        before anything waits for it: on a GPU, what the caller does then overlaps the device's work."""
        inputs = self.prepare(batch)
        hidden = self._hidden_states(inputs)
        if on_launched is not None:
            on_launched()
        prompt_logprobs = self._prompt_logprobs(hidden, inputs)
        seqs = inputs.sample_seqs
        if not seqs:
            return StepOutput({}, {}, prompt_logprobs)
        # Without prompt-logprob rows the hidden rows are exactly the sampling rows, in order.
        logits = self.model.compute_logits(hidden[inputs.sample_rows] if inputs.prompt_rows else hidden)
        if len(inputs.sample_rows) > len(seqs):
            out = self._sample_speculative(logits, seqs)
            out.prompt_logprobs = prompt_logprobs
            return out
        tokens, logprobs = self.sampler(logits, seqs)
        return StepOutput(
            sampled={s.request_id: [t] for s, t in zip(seqs, tokens)},
            logprobs={s.request_id: [lp] for s, lp in zip(seqs, logprobs) if lp is not None},
            prompt_logprobs=prompt_logprobs,
        )

    def _sample_speculative(self, logits: torch.Tensor, seqs: list[ScheduledSequence]) -> StepOutput:
        """Plain rows through the sampler, each speculating sequence's 1 + k rows through `verify`."""
        plain, spec, plain_rows, spec_rows, row = [], [], [], [], 0
        for seq in seqs:
            n = 1 + len(seq.spec_token_ids)
            (spec if n > 1 else plain).append(seq)
            (spec_rows if n > 1 else plain_rows).extend(range(row, row + n))
            row += n
        out = StepOutput({}, {})
        if plain:
            tokens, logprobs = self.sampler(logits[plain_rows], plain)
            out.sampled.update((s.request_id, [t]) for s, t in zip(plain, tokens))
            out.logprobs.update((s.request_id, [lp]) for s, lp in zip(plain, logprobs) if lp is not None)
        spec_logits = logits[spec_rows]
        kept = verify(spec_logits, spec, [s.spec_token_ids for s in spec])
        out.sampled.update((s.request_id, t) for s, t in zip(spec, kept))
        row = 0
        for seq, tokens in zip(spec, kept):
            if seq.params.logprobs is not None:  # of the raw logits, as the sampler's (bias not added)
                lp = torch.log_softmax(spec_logits[row : row + len(tokens)], -1)
                out.logprobs[seq.request_id] = top_logprobs_rows(lp, seq.params.logprobs, tokens)
            row += 1 + len(seq.spec_token_ids)
        return out

    def _hidden_states(self, inputs: StepInputs) -> torch.Tensor:
        """Final hidden states at `inputs.logits_indices`: a graph replay for decode-only steps that
        fit one, else eager."""
        if self.graphs is not None and inputs.is_decode_only and self.graphs.fits(inputs.meta):
            return self.graphs.run(inputs.input_ids, inputs.positions, inputs.metas)
        dev = inputs.to(self.device)
        metas = [dev.metas[g] for g in self.layer_groups]
        return self.model.hidden_states(dev.input_ids, dev.positions, metas, self.kv_caches, dev.logits_indices)

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        ids: list[int] = []
        positions: list[int] = []
        groups = range(self.spec.num_groups)
        slots: list[list[int]] = [[] for _ in groups]
        tables: list[list[list[int]]] = [[] for _ in groups]
        cu, seq_lens, logits_idx, sample_rows, sample_seqs, prompt_rows = [0], [], [], [], [], []
        bs = self.block_size
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            end = start + n
            row0 = len(ids)
            drafts = seq.spec_token_ids
            ids.extend(seq.token_ids[start:end])
            if drafts:
                ids.extend(drafts)
            positions.extend(range(start, end))
            for group_slots, group_tables, table in zip(slots, tables, seq.block_tables):
                if n == 1:  # decodes: most rows of most steps
                    group_slots.append(table[start // bs] * bs + start % bs)
                else:
                    group_slots.extend(slots_of(table, start, end, bs))
                group_tables.append(table)
            cu.append(len(ids))
            seq_lens.append(end)
            if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                count = min(end, seq.num_prompt_tokens - 1) - start
                prompt_rows.append((seq, len(logits_idx), start, count))
                logits_idx.extend(range(row0, row0 + count))
            if end == seq.num_tokens + len(drafts):
                first = len(ids) - 1 - len(drafts)
                sample_rows.extend(range(len(logits_idx), len(logits_idx) + 1 + len(drafts)))
                sample_seqs.append(seq)
                logits_idx.extend(range(first, len(ids)))
        cu_seqlens_q, lens = self._host(cu, torch.int32), self._host(seq_lens, torch.int32)
        metas = [
            AttentionMetadata(cu_seqlens_q, lens, self._block_table(tables[g]), self._host(slots[g], torch.int64))
            for g in groups
        ]
        return StepInputs(
            input_ids=self._host(ids, torch.long),
            positions=self._host(positions, torch.long),
            metas=metas,
            logits_indices=self._host(logits_idx, torch.long),
            sample_rows=sample_rows,
            sample_seqs=sample_seqs,
            prompt_rows=prompt_rows,
        )

    def _block_table(self, tables: list[list[int]]) -> torch.Tensor:
        """Rows padded to the widest. Entries a sliding window left behind (NULL_BLOCK) read as
        block 0: no kernel visits them, and a valid id keeps any stray read in bounds."""
        host = self._host(padded(tables), torch.int32)
        return host.clamp_(min=0) if self.spec.is_hybrid else host

    def _host(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """Host list -> tensor; pinned on CUDA so the step's uploads are non-blocking copies that
        overlap instead of each waiting for the GPU."""
        host = torch.tensor(values, dtype=dtype)
        return host.pin_memory() if self.device.type == "cuda" else host

    def _prompt_logprobs(self, hidden: torch.Tensor, inputs: StepInputs) -> dict[str, list[TopLogprobs | None]]:
        """Row for position p is the distribution of prompt token p+1 (vLLM's prompt_logprobs).

        Logits are made `PROMPT_LOGPROB_ROWS` rows at a time: a whole 8192-token chunk of a
        262k-vocabulary model would need 8.6 GB of fp32 logits at once."""
        out: dict[str, list[TopLogprobs | None]] = {}
        for seq, row0, pos0, count in inputs.prompt_rows:
            new: list[TopLogprobs | None] = [] if seq.prompt_logprobs else [None]
            recorded = len(seq.prompt_logprobs) + len(new)
            for first in range(0, count, PROMPT_LOGPROB_ROWS):
                # Positions already recorded before a preemption are not recorded again.
                targets = [t for t in range(pos0 + first + 1, pos0 + min(count, first + PROMPT_LOGPROB_ROWS) + 1)
                           if t >= recorded]
                if not targets:
                    continue
                rows = hidden[row0 + targets[0] - pos0 - 1 : row0 + targets[-1] - pos0]
                lp = torch.log_softmax(self.model.compute_logits(rows), -1)
                ids = [seq.token_ids[t] for t in targets]
                new.extend(top_logprobs_rows(lp, seq.params.prompt_logprobs, ids))
                recorded += len(targets)
            out[seq.request_id] = new
        return out
