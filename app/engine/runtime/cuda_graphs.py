"""Decode-only steps on static, bucketed inputs, replayed as CUDA graphs.

A decode step of a small batch launches several hundred small kernels (norms, RoPE, attention, the
GEMMs of every layer); on a fast GPU launching them costs more than running them. A CUDA graph
records the whole forward once per batch-size bucket and replays it with one launch.

Graphs replay on fixed addresses and fixed shapes, so every input lives in a static buffer sized for
the largest bucket. A step of n sequences runs the graph of the smallest bucket b >= n; rows n..b-1
are padding: each is a one-token sequence of context 1 whose key/value store is skipped (slot -1),
so it reads a valid block and writes nothing. The graph ends at the final norm: the vocabulary
projection runs eagerly on the n real rows (vLLM and nano-vllm do the same), so padding rows cost
no logits and the graphs hold no `[bucket, vocab]` outputs. Prefill and mixed steps run eagerly
(their shapes vary too much to capture).

With `--enforce-eager` (or when a capture fails) the same padded buckets run op by op: same shapes,
same kernels and launch choices (e.g. split-KV, which depends on the block table's width), so graph
and eager decodes give identical numbers.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from app.engine.runtime.decoder import DecoderLM
from app.kernels import AttentionMetadata, KVCacheLayer

log = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's buckets: 1, 2, 4, then every multiple of 8, capped by (and including) max_num_seqs."""
    sizes = {b for b in (1, 2, 4) if b <= max_num_seqs}
    sizes.update(range(8, max_num_seqs + 1, 8))
    sizes.add(max_num_seqs)
    return sorted(sizes)


class Replayable(Protocol):
    def replay(self) -> None: ...


@dataclass
class _Captured:
    graph: Replayable
    hidden: torch.Tensor  # [bucket, hidden_size], rewritten by every replay


class DecodeGraphs:
    """Static decode inputs plus one captured forward per bucket; `run()` fills and replays (or,
    for a bucket without a graph, runs the same forward eagerly)."""

    def __init__(
        self, model: DecoderLM, kv_caches: list[KVCacheLayer], max_num_seqs: int, max_blocks_per_seq: int,
        layer_groups: list[int] | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_blocks_per_seq = max_blocks_per_seq
        # The KV cache group of each layer (kv_cache_spec): each group has its own tables and slots.
        self.layer_groups = layer_groups or [0] * len(kv_caches)
        n, dev = self.sizes[-1], model.device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        # One query per sequence in every bucket: cu_seqlens_q never changes.
        cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=dev)
        seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        # The largest bucket's metadata per group; a bucket's forward reads a prefix of it.
        self.metas = [
            AttentionMetadata(
                cu_seqlens_q=cu_seqlens_q,
                seq_lens=seq_lens,
                block_table=torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev),
                slot_mapping=torch.full((n,), -1, dtype=torch.long, device=dev),
            )
            for _ in range(max(self.layer_groups) + 1)
        ]
        self.graphs: dict[int, _Captured] = {}  # empty: every bucket runs eagerly
        self._stream: torch.cuda.Stream | None = None
        self._pool = None

    @property
    def meta(self) -> AttentionMetadata:
        """The first group's static metadata (the only one without sliding-window groups)."""
        return self.metas[0]

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def capture_all(self) -> None:
        """Capture every bucket, largest first: the smaller graphs then fit in the memory pool the
        largest one reserved. Raises if a capture fails; the buckets then run eagerly."""
        stream = torch.cuda.current_stream() if torch.cuda.is_available() else None
        try:
            for size in reversed(self.sizes):
                self.graphs[size] = self._capture(size)
        except BaseException:
            self.graphs.clear()
            # A failed capture_end() skips torch.cuda.graph's stream restore: leave no step on its side stream.
            if stream is not None:
                torch.cuda.set_stream(stream)
            raise

    def fits(self, meta: AttentionMetadata) -> bool:
        return meta.num_seqs <= self.max_batch_size and meta.block_table.shape[1] <= self.max_blocks_per_seq

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metas: AttentionMetadata | list[AttentionMetadata]
    ) -> torch.Tensor:
        """One decode token per sequence (pinned host or device tensors; `cu_seqlens_q` is not read)
        -> final hidden states `[num_seqs, hidden_size]`, a view of the graph's output valid until
        the next replay. `metas`: one per KV cache group (or the one of a single group)."""
        metas = metas if isinstance(metas, list) else [metas]
        n = input_ids.shape[0]
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        first = self.metas[0]
        # Columns past the step's widest table keep stale block ids: no sequence reads that far.
        for buffer, value in ((self.input_ids, input_ids), (self.positions, positions), (first.seq_lens, metas[0].seq_lens)):
            buffer[:n].copy_(value, non_blocking=True)
        for static, meta in zip(self.metas, metas):
            static.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
            static.block_table[:n, : meta.block_table.shape[1]].copy_(meta.block_table, non_blocking=True)
            # Padding rows: whatever an earlier, larger step left there must not store KV.
            static.slot_mapping[n:size].fill_(-1)
        # ...nor read far: a padding row is a context of one token.
        first.seq_lens[n:size].fill_(1)
        captured = self.graphs.get(size)
        if captured is None:  # eager: the same padded bucket, launched op by op
            return self._forward(size)[:n]
        captured.graph.replay()
        return captured.hidden[:n]

    def _forward(self, size: int) -> torch.Tensor:
        # Views of the static buffers: a graph records their addresses, not these objects.
        metas = [
            AttentionMetadata(
                cu_seqlens_q=static.cu_seqlens_q[: size + 1],
                seq_lens=static.seq_lens[:size],
                block_table=static.block_table[:size],
                slot_mapping=static.slot_mapping[:size],
            )
            for static in self.metas
        ]
        layer_metas = [metas[g] for g in self.layer_groups]
        return self.model.hidden_states(self.input_ids[:size], self.positions[:size], layer_metas, self.kv_caches)

    def _capture(self, size: int) -> _Captured:
        # Every slot is -1 here: neither the warm-up nor the capture writes into the KV cache.
        for static in self.metas:
            static.slot_mapping.fill_(-1)
        self.meta.seq_lens.fill_(1)
        if self._stream is None:
            self._stream = torch.cuda.Stream()
            self._pool = torch.cuda.graph_pool_handle()
        # Warm up on the capture stream (PyTorch's advice): Triton compiles, cuBLAS makes its
        # workspace for that stream, and the allocator settles before anything is recorded.
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            self._forward(size)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: a CUDA call from another thread (the UI, a server) does not spoil the capture.
        with torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
            hidden = self._forward(size)
        torch.cuda.synchronize()
        return _Captured(graph, hidden)
