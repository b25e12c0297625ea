"""A draft model for speculative decoding: a small model of the same vocabulary proposes k tokens
per sequence by greedy decoding, all sequences batched in each of its k forwards.

Its KV pool has the target's block count and block size and is addressed by the target's block
tables, so it needs no allocator of its own: the target's scheduler already reserved every slot a
draft writes (positions below the target's verify positions).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from app.engine.runtime.decoder import DecoderLM
from app.engine.runtime.kv_pool import allocate_kv_caches
from app.engine.runtime.model_runner import padded, slots_of
from app.kernels import AttentionMetadata, cpu_ops


@dataclass
class DraftRequest:
    token_ids: list[int]  # the sequence's tokens so far (verified)
    num_computed: int  # tokens whose draft KV is already in the pool
    block_table: list[int]
    k: int  # tokens to propose


class DraftModel:
    def __init__(self, model: DecoderLM, num_blocks: int, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        self.kv_caches = allocate_kv_caches(model.cfg, num_blocks, block_size, model.kv_dtype, model.device)
        self.last_round_s: float | None = None  # the last call's one-token-a-request forward, seconds

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        """Greedy drafts of each request's k tokens. The first forward catches each request up from
        `num_computed` (its whole prompt the first time); each later one is one token a request."""
        drafts: list[list[int]] = [[] for _ in requests]
        chunks = [(r.token_ids[r.num_computed :], r.num_computed) for r in requests]
        live = list(range(len(requests)))
        self.last_round_s = None
        while live:
            start = time.perf_counter()
            tokens = self._forward([chunks[i] for i in live], [requests[i].block_table for i in live])
            if all(len(chunks[i][0]) == 1 for i in live):  # not a catch-up: what one more draft token costs
                self.last_round_s = time.perf_counter() - start
            for i, token in zip(live, tokens):
                drafts[i].append(token)
                chunks[i] = ([token], chunks[i][1] + len(chunks[i][0]))
            live = [i for i in live if len(drafts[i]) < requests[i].k]
        return drafts

    def _forward(self, chunks: list[tuple[list[int], int]], tables: list[list[int]]) -> list[int]:
        """One packed forward over (tokens, first position) chunks: the argmax after each chunk."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu, seq_lens, last_rows = [0], [], []
        bs = self.block_size
        for (tokens, start), table in zip(chunks, tables):
            end = start + len(tokens)
            ids.extend(tokens)
            positions.extend(range(start, end))
            slots.extend(slots_of(table, start, end, bs))
            cu.append(len(ids))
            seq_lens.append(end)
            last_rows.append(len(ids) - 1)
        meta = AttentionMetadata(
            torch.tensor(cu, dtype=torch.int32),
            torch.tensor(seq_lens, dtype=torch.int32),
            torch.tensor(padded(tables), dtype=torch.int32),
            torch.tensor(slots, dtype=torch.int64),
        ).to(self.model.device)
        dev = self.model.device
        hidden = self.model.hidden_states(
            torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), meta, self.kv_caches,
            torch.tensor(last_rows, device=dev),
        )
        return cpu_ops.argmax(self.model.compute_logits(hidden)).tolist()
