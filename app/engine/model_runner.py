"""Turns a scheduled batch into one flat forward pass and samples its next tokens.

The step's tokens are packed back to back (no padding): prefill chunks of several prompts and
single decode tokens side by side, described by `cu_seqlens_q`, `seq_lens`, `block_table` and
`slot_mapping`. Logits are computed only at `logits_indices`: the last row of each sequence whose
step reaches the end of its tokens, plus every row of a chunk whose prompt logprobs were asked.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from app.engine.attention import AttentionMetadata
from app.engine.models.decoder import DecoderLM
from app.engine.outputs import TopLogprobs
from app.engine.sampling import Sampler, top_logprobs
from app.engine.scheduler import ScheduledBatch
from app.engine.sequence import Sequence


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sample_rows: list[int]  # row in the logits of each sampling sequence
    sample_seqs: list[Sequence]
    prompt_rows: list[tuple[Sequence, int, int, int]]  # (seq, first logits row, first position, count)


@dataclass
class StepOutput:
    sampled: dict[str, int]  # request_id -> new token
    logprobs: dict[str, TopLogprobs]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled pool. Attention kernels may read (and mask) slots past a sequence's end, so they
    must hold finite values. On the CPU the zeros come from an anonymous mmap: the OS maps zero
    pages on first touch, so a pool of several GB costs no start-up time and no RSS until used."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=dtype, count=math.prod(shape)).view(shape)


class ModelRunner:
    def __init__(self, model: DecoderLM, num_blocks: int, block_size: int, kv_dtype: torch.dtype) -> None:
        cfg = model.cfg
        self.model = model
        self.device = model.device
        self.block_size = block_size
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [(_zeros(shape, kv_dtype, self.device), _zeros(shape, kv_dtype, self.device)) for _ in range(cfg.num_layers)]
        self.sampler = Sampler(cfg.vocab_size)

    def run(self, batch: ScheduledBatch) -> StepOutput:
        inputs = self.prepare(batch)
        logits = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches, inputs.logits_indices)
        self._record_prompt_logprobs(logits, inputs)
        seqs = inputs.sample_seqs
        if not seqs:
            return StepOutput({}, {})
        tokens, logprobs = self.sampler(logits[inputs.sample_rows], seqs)
        return StepOutput(
            sampled={s.request_id: t for s, t in zip(seqs, tokens)},
            logprobs={s.request_id: lp for s, lp in zip(seqs, logprobs) if lp is not None},
        )

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu, seq_lens, tables, logits_idx, sample_rows, sample_seqs, prompt_rows = [0], [], [], [], [], [], []
        bs = self.block_size
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            end = start + n
            row0 = len(ids)
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            cu.append(len(ids))
            seq_lens.append(end)
            tables.append(table)
            if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                count = min(end, seq.num_prompt_tokens - 1) - start
                prompt_rows.append((seq, len(logits_idx), start, count))
                logits_idx.extend(range(row0, row0 + count))
            if end == seq.num_tokens:
                sample_rows.append(len(logits_idx))
                sample_seqs.append(seq)
                logits_idx.append(len(ids) - 1)
        width = max(len(t) for t in tables)
        table_rows = [t + [0] * (width - len(t)) for t in tables]
        meta = AttentionMetadata(
            cu_seqlens_q=self._upload(cu, torch.int32),
            seq_lens=self._upload(seq_lens, torch.int32),
            block_table=self._upload(table_rows, torch.int32),
            slot_mapping=self._upload(slots, torch.int64),
        )
        return StepInputs(
            input_ids=self._upload(ids, torch.long),
            positions=self._upload(positions, torch.long),
            meta=meta,
            logits_indices=self._upload(logits_idx, torch.long),
            sample_rows=sample_rows,
            sample_seqs=sample_seqs,
            prompt_rows=prompt_rows,
        )

    def _upload(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """Host list -> device tensor; on CUDA through pinned memory with a non-blocking copy, so
        the step's metadata uploads overlap instead of each waiting for the GPU."""
        host = torch.tensor(values, dtype=dtype)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _record_prompt_logprobs(self, logits: torch.Tensor, inputs: StepInputs) -> None:
        """Row for position p is the distribution of prompt token p+1 (vLLM's prompt_logprobs)."""
        for seq, row0, pos0, count in inputs.prompt_rows:
            if not seq.prompt_logprobs:
                seq.prompt_logprobs.append(None)
            lp = torch.log_softmax(logits[row0 : row0 + count], -1)
            k = seq.params.prompt_logprobs
            for j in range(count):
                target = pos0 + j + 1
                if target == len(seq.prompt_logprobs):  # skip positions already recorded before a preemption
                    seq.prompt_logprobs.append(top_logprobs(lp[j], k, seq.token_ids[target]))
